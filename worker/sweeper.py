"""Recovery of abandoned work, run by every worker, acted on by one at a time.

Each round: running jobs whose lease expired, or whose lease owner is gone (its presence
lapsed: killed, crashed), go back to the queue (or end `failed` when their attempts are
spent, `cancelled` when a cancel was asked); queued jobs with no live message (never sent,
released, or lost with a Redis restart) are sent again.

A gone owner is looked for every `presence_check_seconds`, between full rounds, so its jobs
run again within seconds rather than after their leases. Should the owner be alive after
all (paused, its presence writes late), the new claim's epoch fences it off.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from redis.exceptions import RedisError

from app.db import Database
from app.domain.status import JobStatus
from app.events import JobEvents, end_event
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
        self._events = events
        self._max_attempts = max_attempts
        self._grace = grace_seconds
        self._interval = interval_seconds
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="llmq-sweeper", daemon=True)

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
            stale = self._store.stale_queued(self._grace)
            to_check = [job.job_id for job, never_sent in stale if not never_sent]
            missing = set(self._queue.missing_markers(to_check))
            missing |= self._vanished([job for job, never_sent in stale if not never_sent], missing)
            lost_lines = []
            for job, never_sent in stale:
                if job.batch_id is not None and job.job_id in missing:
                    lost_lines.append(job.job_id)  # the feeder sends it again, in a chunk
                elif never_sent or job.job_id in missing:
                    self._queue.enqueue(job.job_id, job.model, job.priority)
                    report.resent += 1
            self._store.mark_enqueued([job.job_id for job, _ in stale if job.job_id not in lost_lines])
            self._store.undispatch(lost_lines)
            report.resent += len(lost_lines)
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
        """Deliveries older than the grace whose jobs are still queued: the worker that
        took them died (or hung) before claiming. Their markers go, so they are sent again
        below; a late claim by a hung worker loses to the fence. Deliveries of jobs just
        re-queued for an expired lease go too (their job is sent again anyway), uncounted."""
        deliveries = self._queue.stale_deliveries(self._grace)
        if not deliveries:
            return 0
        queued = self._store.queued_among([j for ids in deliveries.values() for j in ids])
        tags = [tag for tag, ids in deliveries.items() if queued.intersection(ids)]
        if not tags:
            return 0
        self._queue.drop_deliveries(tags)
        self._queue.forget(*queued)
        unclaimed = len(queued - requeued)
        if unclaimed:
            log.warning("messages taken but never claimed; sending again", extra={"jobs": unclaimed})
        return unclaimed

    def _vanished(self, candidates: list[Expired], missing: set[str]) -> set[str]:
        """Jobs whose marker says "sent" but whose message is nowhere: their queue is empty
        and no delivery names them (a worker took the message and died before recording
        the delivery). A message taken this very moment may be counted too; the fence makes
        the second copy harmless."""
        rest = [job for job in candidates if job.job_id not in missing]
        idle = {model for model in {job.model for job in rest} if self._queue.depth(model) == 0}
        rest = [job for job in rest if job.model in idle]
        if not rest:
            return set()
        held = self._queue.delivered_job_ids()
        gone = {job.job_id for job in rest if job.job_id not in held}
        if gone:
            self._queue.forget(*gone)
            log.warning("messages lost in a worker's crash; sending again", extra={"jobs": len(gone)})
        return gone

    def _loop(self) -> None:
        due = time.monotonic() + self._interval
        while not self._stop.wait(min(self._interval, self._presence_check)):
            try:
                if time.monotonic() >= due or self._gone_owners():
                    due = time.monotonic() + self._interval
                    self.sweep_once()
            except Exception as exc:  # noqa: BLE001 - Postgres or Redis down: try next round
                log.warning("sweep failed", extra={"error": f"{type(exc).__name__}: {exc}"})

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
