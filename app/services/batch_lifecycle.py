"""What moves batches along without a request: feeding their lines to the broker at a
bounded rate, ending them at their deadline, and finalizing them when no line is left.
Run by workers (worker/batches.py), one at a time under Postgres advisory locks."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import exists, select, text, update

from app.db import Database
from app.domain.status import BatchStatus, FilePurpose, JobStatus
from app.events import JobEvents
from app.ids import new_id
from app.liveness import FEEDER_PLANS, OUT_BY_TENANT, OWED_BY_TENANT, OWED_MODELS, TAKE_OWED, owed_order
from app.models import Batch, File, Job
from app.queue import JobQueue
from app.services import webhook_outbox
from app.services.batch_output import output_lines
from app.services.batch_transitions import BATCH_COUNTS, end_lines, materialize, tell_ended
from app.services.dispatch import DispatchPlan, dispatch_plan
from app.services.fair_share import FairShare
from app.services.webhook_outbox import Event

log = logging.getLogger("llmq.batches")

CAPACITY_TTL_SECONDS = 2.0
# Whether any batch may still need the scheduler: one probe of the partial index
# ix_batches_active (its predicate, word for word, so the planner uses it).
ANY_ACTIVE = text(
    "SELECT EXISTS (SELECT 1 FROM batches "
    "WHERE status IN ('validating','in_progress','cancelling','finalizing'))"
)


@dataclass
class FeedReport:
    lines: int = 0
    messages: int = 0
    # Whether any line was owed a message when the round began.
    owed: bool = False


class BatchLifecycle:
    """`capacities(model)`: the in-flight capacity of each live worker serving `model`
    (the registry); the window and chunk follow from it (app/services/dispatch.py), with
    `window` as a ceiling. Without `capacities`, `window` (else `cold_window`) and `chunk`
    are fixed."""

    def __init__(
        self,
        db: Database,
        queue: JobQueue,
        events: JobEvents,
        *,
        chunk: int,
        window: int | None = None,
        capacities: Callable[[str], Sequence[int]] | None = None,
        headroom: float = 1.5,
        cold_window: int = 256,
        share: FairShare | None = None,
    ) -> None:
        self._db = db
        self._queue = queue
        self._events = events
        self._window = window
        self._chunk = chunk
        self._capacities = capacities
        self._headroom = headroom
        self._cold_window = cold_window
        self._share = share or FairShare()
        self._live: dict[str, tuple[float, Sequence[int]]] = {}

    def plan(self, model: str) -> DispatchPlan:
        """Lines that may be out (sent or running) for `model`, and lines per message."""
        if self._capacities is None:
            window = self._window or self._cold_window
            return DispatchPlan(window=window, chunk=max(1, min(self._chunk, window)))
        seen = self._live.get(model)
        if seen is None or time.monotonic() - seen[0] > CAPACITY_TTL_SECONDS:
            seen = (time.monotonic(), self._capacities(model))  # a registry read: not every tick
            self._live[model] = seen
        return dispatch_plan(
            seen[1],
            headroom=self._headroom,
            chunk=self._chunk,
            cold_window=self._cold_window,
            ceiling=self._window,
        )

    def window(self, model: str) -> int:
        return self.plan(model).window

    def any_active(self) -> bool:
        """Whether any batch is validating, in progress, cancelling or finalizing. When
        none is, no line is owed (a line waits only in such a batch) and nothing is due to
        end or finalize: a scheduler's round stops at this one read."""
        with self._db.reading() as s:
            return bool(s.scalar(ANY_ACTIVE))

    def feed(self) -> FeedReport:
        """Send waiting batch lines to the broker while fewer than `window` lines per model
        are out, sharing that room among tenants by weight (app/services/fair_share.py),
        each tenant's lines in priority order, then earliest deadline first. A 50,000-line
        batch thus never floods Redis nor holds another tenant's batch back, and single jobs
        (sent at once, at a higher broker priority) never wait behind it."""
        report = FeedReport()
        with self._db.reading() as s:  # one round trip: most rounds end here, with none owed
            models = list(s.scalars(OWED_MODELS))
        report.owed = bool(models)
        for model in models:
            plan = self.plan(model)
            window, chunk = plan.window, plan.chunk
            with self._db.session() as s:
                s.execute(FEEDER_PLANS)
                out = {r.tenant_id: int(r.n) for r in s.execute(OUT_BY_TENANT, {"model": model})}
                room = window - sum(out.values())
                if room < chunk:
                    continue
                owed = s.execute(OWED_BY_TENANT, {"model": model, "cap": room}).all()
                waiting = {r.tenant_id: int(r.n) for r in owed}
                weights = {r.tenant_id: float(r.weight) for r in owed}
                picks = self._share.pick(waiting, room, weights, out)
                taken = {
                    tenant: iter(
                        sorted(
                            s.execute(TAKE_OWED, {"model": model, "tenant": tenant, "n": n}).all(),
                            key=owed_order,
                        )
                    )
                    for tenant, n in Counter(picks).items()
                }
            # Interleaved as picked, so the first message already carries every tenant's lines.
            rows = [row for row in (next(taken[t], None) for t in picks) if row is not None]
            for start in range(0, len(rows), chunk):
                part = rows[start : start + chunk]
                # If this send fails, the sweeper finds the lines without a message and
                # gives them back to the feeder (app/liveness.py, row 4).
                self._queue.enqueue_chunk([r.id for r in part], model, min(r.priority for r in part))
                report.messages += 1
            report.lines += len(rows)
        return report

    def expire_due(self) -> int:
        """End batches past their completion window: unfinished lines become expired
        (running ones fenced off and aborted), finished work stays."""
        now = datetime.now(UTC)
        with self._db.session() as s:
            due = list(
                s.scalars(
                    select(Batch.id).where(
                        Batch.status == BatchStatus.IN_PROGRESS.value,
                        Batch.expires_at < now,
                        Batch.expired_at.is_(None),
                        # A batch whose every line ended before this sweep is completed,
                        # not expired: its window passed with nothing left to end.
                        exists().where(
                            Job.batch_id == Batch.id,
                            Job.status.in_((JobStatus.QUEUED.value, JobStatus.RUNNING.value)),
                        ),
                    )
                )
            )
            if due:
                s.execute(update(Batch).where(Batch.id.in_(due)).values(expired_at=now))
        for batch_id in due:
            ended = end_lines(self._db, batch_id, JobStatus.EXPIRED)
            tell_ended(self._events, ended, JobStatus.EXPIRED)
            log.warning("batch expired", extra={"batch_id": batch_id, "lines_expired": len(ended)})
        return len(due)

    def end_left_lines(self, grace_seconds: float = 5.0) -> int:
        """Batches cancelled or expired more than `grace_seconds` ago with lines still
        unfinished (the API died between marking the batch and ending its lines, or a line
        stayed locked past end_lines' patience) get those lines ended now."""
        with self._db.session() as s:
            left = s.execute(
                text(
                    "SELECT b.id, b.status FROM batches b WHERE "
                    "((b.status = 'cancelling' AND b.cancelling_at < now() - make_interval(secs => :g)) "
                    " OR (b.status = 'in_progress' AND b.expired_at < now() - make_interval(secs => :g))) "
                    "AND EXISTS (SELECT 1 FROM jobs j WHERE j.batch_id = b.id "
                    "            AND j.status IN ('queued', 'running'))"
                ),
                {"g": grace_seconds},
            ).all()
        for batch_id, batch_status in left:
            cancelled = batch_status == BatchStatus.CANCELLING.value
            status = JobStatus.CANCELLED if cancelled else JobStatus.EXPIRED
            ended = end_lines(self._db, batch_id, status)
            tell_ended(self._events, ended, status)
            log.warning(
                "batch lines left unfinished by its end; ended now",
                extra={"batch_id": batch_id, "status": status.value, "lines_ended": len(ended)},
            )
        return len(left)

    def resume_validating(self, grace_seconds: float = 60.0) -> int:
        """Batches left `validating` (the API died between committing the batch and
        turning its lines into jobs) get their jobs now."""
        with self._db.session() as s:
            stale = list(
                s.scalars(
                    text(
                        "SELECT id FROM batches WHERE status = 'validating' "
                        "AND created_at < now() - make_interval(secs => :grace)"
                    ),
                    {"grace": grace_seconds},
                )
            )
        resumed = sum(materialize(self._db, batch_id) for batch_id in stale)
        if resumed:
            log.warning("batches resumed from validating", extra={"batches": resumed})
        return resumed

    def finalize_done(self) -> int:
        """Batches with no line left to run pass through `finalizing` (their output and
        error files are measured) to their final status: completed, cancelled (was
        cancelling) or expired. A batch left `finalizing` by a crash is finished here."""
        with self._db.session() as s:
            candidates = list(
                s.scalars(
                    text(
                        "SELECT b.id FROM batches b "
                        "WHERE b.status IN ('in_progress', 'cancelling', 'finalizing') AND NOT EXISTS "
                        "(SELECT 1 FROM jobs j WHERE j.batch_id = b.id AND j.status IN ('queued', 'running'))"
                    )
                )
            )
        for batch_id in candidates:
            self._finalize(batch_id)
        return len(candidates)

    def _finalize(self, batch_id: str) -> None:
        with self._db.session() as s:
            batch = s.scalar(select(Batch).where(Batch.id == batch_id).with_for_update())
            if batch is None or batch.status not in (
                BatchStatus.IN_PROGRESS.value,
                BatchStatus.CANCELLING.value,
                BatchStatus.FINALIZING.value,
            ):
                return
            # OpenAI's states: a batch that ran to its end is `finalizing` while its files are
            # made; a cancelled one stays `cancelling` until it is `cancelled`.
            if batch.status == BatchStatus.IN_PROGRESS.value:
                batch.status = BatchStatus.FINALIZING.value
                batch.finalizing_at = datetime.now(UTC)
        # Every line has ended, so the files' contents are fixed: measure them with no
        # lock held (rendering a 50,000-line output takes a while).
        with self._db.session() as s:
            counts = {row.status: row.n for row in s.execute(BATCH_COUNTS, {"batch": batch_id})}
        succeeded = counts.get(JobStatus.SUCCEEDED.value, 0)
        others = sum(n for status, n in counts.items() if status != JobStatus.SUCCEEDED.value)
        sizes = {
            part: sum(len(line) for line in output_lines(self._db, batch_id, part))
            for part, lines in (("output", succeeded), ("errors", others))
            if lines
        }
        now = datetime.now(UTC)
        with self._db.session() as s:
            batch = s.scalar(select(Batch).where(Batch.id == batch_id).with_for_update())
            if batch is None or batch.status not in (
                BatchStatus.FINALIZING.value,
                BatchStatus.CANCELLING.value,
            ):
                return  # another finalizer got there first
            if "output" in sizes:
                batch.output_file_id = self._output_file(s, batch, "output", sizes["output"])
            if "errors" in sizes:
                batch.error_file_id = self._output_file(s, batch, "errors", sizes["errors"])
            values: dict[str, Any]
            if batch.cancelling_at is not None:
                values = {"status": BatchStatus.CANCELLED.value, "cancelled_at": now}
            elif batch.expired_at is not None:
                values = {"status": BatchStatus.EXPIRED.value}
            else:
                values = {"status": BatchStatus.COMPLETED.value, "completed_at": now}
            for key, value in values.items():
                setattr(batch, key, value)
            # The batch's webhook event commits with its final status.
            webhook_outbox.record(s, [Event(batch.tenant_id, f"batch.{values['status']}", batch.id)])
        log.info(
            "batch finalized",
            extra={
                "batch_id": batch_id,
                "status": values["status"],
                "succeeded": succeeded,
                "not_succeeded": others,
            },
        )

    @staticmethod
    def _output_file(s: Any, batch: Batch, part: str, size: int) -> str:
        """An output or error file's row; with `output_expires_after`, it expires (and the
        lines' texts with it) that long after now, its creation (OpenAI's anchor)."""
        file_id = new_id("file")
        created = datetime.now(UTC)
        expires = batch.output_expires_after
        s.add(
            File(
                id=file_id,
                tenant_id=batch.tenant_id,
                purpose=FilePurpose.BATCH_OUTPUT.value,
                filename=f"{batch.id}_{part}.jsonl",
                bytes=size,
                line_count=0,
                batch_id=batch.id,
                batch_part=part,
                created_at=created,
                expires_at=created + timedelta(seconds=expires) if expires is not None else None,
            )
        )
        return file_id
