"""Recovery of abandoned work, run by every worker, acted on by one at a time.

Each round: running jobs whose lease expired, or whose lease owner is gone (its presence
lapsed: killed, crashed), go back to the queue (or end `failed` when their attempts are
spent, `cancelled` when a cancel was asked); queued jobs with no live message (never sent,
released, or lost with a Redis restart) are sent again. What counts as a live message, and
what each case gets, is app/liveness.py's table; this module keeps the loop and the lock.

A gone owner is looked for every `presence_check_seconds`, between full rounds, so its jobs
run again within seconds rather than after their leases. Should the owner be alive after
all (paused, its presence writes late), the new claim's epoch fences it off. Each look and
each full round is made by one worker of the fleet, the first to ask in its period
(`LeaseLock.turn`): the others skip it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from redis.exceptions import RedisError

from app.db import Database
from app.domain.status import JobStatus
from app.events import JobEvents, end_event
from app.liveness import (
    Liveness,
    Observed,
    Stale,
    plan_resends,
    plan_unclaimed,
    sent_before,
    vanish_candidates,
)
from app.periodic import Periodic
from app.queue import JobQueue
from worker.leader import LeaseLock
from worker.store import Expired, JobStore

log = logging.getLogger("llmq.sweeper")


@dataclass
class SweepReport:
    requeued: int = 0
    failed: int = 0
    cancelled: int = 0
    resent: int = 0
    unclaimed: int = 0
    gone_workers: int = 0


class Sweeper:
    def __init__(
        self,
        db: Database,
        store: JobStore,
        queue: JobQueue,
        liveness: Liveness,
        events: JobEvents,
        *,
        max_attempts: int,
        grace_seconds: float,
        interval_seconds: float,
        lock: LeaseLock,
        absent: Callable[[list[str]], set[str]] | None = None,
        presence_check_seconds: float | None = None,
    ) -> None:
        """`absent` says which of the given lease owners are gone (None: owners are only
        given up on when their leases end)."""
        self._lock = lock
        self._absent = absent
        self._presence_check = presence_check_seconds or interval_seconds
        self._db = db
        self._store = store
        self._queue = queue
        self._liveness = liveness
        self._events = events
        self._max_attempts = max_attempts
        self._grace = grace_seconds
        self._interval = interval_seconds
        # A full round every interval; in between, a look for gone owners every few seconds:
        # each by one worker of the fleet (`_tick`).
        self._period = min(interval_seconds, self._presence_check)
        self._periodic = Periodic("llmq-sweeper", self._period, self._tick, log=log)

    def sweep_once(self) -> SweepReport:
        report = SweepReport()
        with self._lock.hold() as mine:
            if not mine:
                return report
            requeued = set()
            released = self._release_gone_owners(report)
            for job in [*released, *self._store.expire_leases(self._max_attempts)]:
                if job.status == JobStatus.QUEUED.value:
                    report.requeued += 1
                    requeued.add(job.job_id)
                    continue
                if job.status == JobStatus.FAILED.value:
                    report.failed += 1
                else:
                    report.cancelled += 1
                error = (job.error or {}).get("error")
                self._events.append_end(job.job_id, end_event(job.epoch, job.status, error))
                log.warning("lease expired; job ended", extra={"job_id": job.job_id, "status": job.status})
            report.unclaimed = self._reclaim_unclaimed(requeued)
            stale = self._liveness.stale_queued(self._grace)
            plan = plan_resends(stale, self._observe(stale))
            if plan.forget:
                self._liveness.spent(*plan.forget)
                log.warning(
                    "messages lost in a worker's crash; sending again", extra={"jobs": len(plan.forget)}
                )
            for resend in plan.send:
                self._queue.enqueue(
                    resend.job_id, resend.model, resend.priority, request_id=resend.request_id
                )
            self._liveness.confirmed(plan.confirm)
            self._liveness.handed_back(plan.hand_back)
            report.resent += plan.resent
        if any(vars(report).values()):
            log.info("sweep", extra=vars(report))
        return report

    def _gone_owners(self) -> list[str]:
        if self._absent is None:
            return []
        owners = self._store.running_owners()
        return sorted(self._absent(owners)) if owners else []

    def _release_gone_owners(self, report: SweepReport) -> list[Expired]:
        try:
            gone = self._gone_owners()
        except RedisError as exc:  # the leases still end: the other rules go on
            log.warning("presence check failed", extra={"error": f"{type(exc).__name__}: {exc}"})
            return []
        if not gone:
            return []
        released = self._store.release_owned_by(gone, self._max_attempts)
        report.gone_workers = len(gone)
        log.warning(
            "workers gone; their running jobs released", extra={"workers": gone, "jobs": len(released)}
        )
        return released

    def _reclaim_unclaimed(self, requeued: set[str]) -> int:
        """Row 8 of app/liveness.py's table: deliveries older than the grace whose jobs are
        still queued. A late claim by a hung worker loses to the fence."""
        deliveries = self._liveness.stale_deliveries(self._grace)
        if not deliveries:
            return 0
        queued = self._liveness.queued_among([j for ids in deliveries.values() for j in ids])
        plan = plan_unclaimed(deliveries, queued, requeued)
        if not plan.tags:
            return 0
        self._liveness.drop_deliveries(plan.tags)
        self._liveness.spent(*plan.forget)
        if plan.count:
            log.warning("messages taken but never claimed; sending again", extra={"jobs": plan.count})
        return plan.count

    def _observe(self, stale: list[Stale]) -> Observed:
        """The facts `plan_resends` needs, read only as far as they are: markers of the jobs
        sent before, then the depth of the queues of those whose marker remains, then the
        deliveries, if any of those queues is empty. A message taken this very moment may
        look vanished; the fence makes the second copy harmless."""
        missing = set(self._liveness.missing_markers(sent_before(stale)))
        rest = vanish_candidates(stale, missing)
        idle = {model for model in {job.model for job in rest} if self._liveness.depth(model) == 0}
        if not any(job.model in idle for job in rest):
            return Observed(missing, idle)
        return Observed(missing, idle, self._liveness.delivered_job_ids())

    def _tick(self) -> None:
        # One worker of the fleet a round, the first to ask: with every worker asking
        # Postgres each second which workers hold running jobs (about 2 ms of Postgres's time
        # with 6,400 of them running), a fleet of 50 cost it 50 such queries a second, and
        # each worker's own full round came once an interval per worker.
        if not self._lock.turn("look", self._period):
            return
        if self._lock.turn("full", self._interval) or self._gone_owners():
            self.sweep_once()

    def start(self) -> None:
        self._periodic.start()

    def stop(self) -> None:
        self._periodic.stop()
