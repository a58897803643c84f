"""A batch's row transitions, shared by its use cases (app/services/batches.py) and its
lifecycle (app/services/batch_lifecycle.py): lines become jobs, unfinished lines end, a
batch that could not be created fails."""

from __future__ import annotations

import json
import logging
import time
from datetime import UTC, datetime

from sqlalchemy import select, text, update

from app.db import Database
from app.domain.line_order import PREFIX_KEY_SQL, prefix_order
from app.domain.status import BatchStatus, JobKind, JobStatus
from app.errors import error_body, error_object, line_error
from app.events import JobEvents, end_event
from app.models import Batch, Tenant
from app.schemas.batches import TEXT_COMPLETIONS_URL
from app.services import webhook_outbox
from app.services.budgets import LINE_TOKENS
from app.services.priority import PriorityBand
from app.services.webhook_outbox import Event

log = logging.getLogger("llmq.batches")

ACTIVE = (BatchStatus.VALIDATING.value, BatchStatus.IN_PROGRESS.value, BatchStatus.CANCELLING.value)
LINE_ERRORS = {
    JobStatus.CANCELLED.value: ("batch_cancelled", "the batch was cancelled before this request finished"),
    JobStatus.EXPIRED.value: (
        "batch_expired",
        "the batch's completion window ended before this request finished",
    ),
}

_CREATE_JOBS = text(
    f"""
    INSERT INTO jobs (id, tenant_id, kind, status, priority, model, request, metadata, attempts, epoch,
                      created_at, enqueued_at, batch_id, deadline_at, custom_id, line_no, budget_tokens,
                      request_id, prefix_key)
    SELECT 'job_' || :suffix || '_' || lpad(fl.line_no::text, 6, '0'), :tenant,
           CASE WHEN (fl.raw::json)->>'url' = :text_url THEN :text_kind ELSE :chat_kind END, 'queued',
           coalesce((b->>'priority')::numeric::int, :default_priority), b->>'model', b, b->'metadata', 0, 0,
           now(), NULL,
           :batch, :deadline, fl.custom_id, fl.line_no, {LINE_TOKENS}, :request_id, {PREFIX_KEY_SQL}
    FROM file_lines fl, LATERAL (SELECT (fl.raw::json)->'body' AS b OFFSET 0) body
    WHERE fl.file_id = :file
    """  # noqa: S608 - LINE_TOKENS and PREFIX_KEY_SQL are constant expressions
)
# `OFFSET 0` keeps the body's subquery from being inlined: inlined, every `b->...` above
# would parse the whole line again (half the INSERT's time on 50,000 lines).

# Lines counted with their token sums (n, prompt, completion, cached): every reading of a
# batch's progress selects these.
LINE_SUMS = """
    count(*) AS n,
    coalesce(sum((usage->>'prompt_tokens')::bigint), 0) AS prompt,
    coalesce(sum((usage->>'completion_tokens')::bigint), 0) AS completion,
    coalesce(sum((usage->'prompt_tokens_details'->>'cached_tokens')::bigint), 0) AS cached
"""

# A batch's progress: its lines by status, with their token sums.
BATCH_COUNTS = text("SELECT status," + LINE_SUMS + "FROM jobs WHERE batch_id = :batch GROUP BY status")

_UNFINISHED_LINES = text(
    "SELECT count(*) FROM jobs WHERE batch_id = :batch AND status IN ('queued', 'running')"
)
# How soon end_lines looks again at lines a worker held locked (its statements take
# milliseconds).
END_LINES_RETRY_SECONDS = 0.01


def materialize(db: Database, batch_id: str) -> bool:
    """Turn a `validating` batch's input lines into its jobs (one INSERT ... SELECT), each
    with its prefix key (app/domain/line_order.py), and move it to `in_progress`.
    Idempotent: a batch no longer validating (done already, or
    cancelled meanwhile) is left as it is. Returns whether this call did it."""
    with db.session() as s:
        batch = s.scalar(select(Batch).where(Batch.id == batch_id).with_for_update())
        if batch is None or batch.status != BatchStatus.VALIDATING.value:
            return False
        tenant = s.get(Tenant, batch.tenant_id)
        band = PriorityBand(tenant.priority_min, tenant.priority_max) if tenant else PriorityBand()
        s.execute(
            _CREATE_JOBS,
            {
                "suffix": batch.id.removeprefix("batch_"),
                "tenant": batch.tenant_id,
                "batch": batch.id,
                "file": batch.input_file_id,
                "default_priority": band.default,
                "deadline": batch.expires_at,
                "request_id": batch.request_id,
                "prefix_order": prefix_order(batch.line_order),
                # A `/v1/completions` line is a text completion job.
                "text_url": TEXT_COMPLETIONS_URL,
                "text_kind": JobKind.COMPLETION.value,
                "chat_kind": JobKind.CHAT.value,
            },
        )
        batch.status = BatchStatus.IN_PROGRESS.value
        batch.in_progress_at = datetime.now(UTC)
    return True


def fail_validating(db: Database, batch_id: str) -> None:
    """End a batch whose lines could not be turned into jobs (the caller got an error)."""
    error = line_error("batch_not_created", "the batch's requests could not be created")
    with db.session() as s:
        failed = s.execute(
            update(Batch)
            .where(Batch.id == batch_id, Batch.status == BatchStatus.VALIDATING.value)
            .values(
                status=BatchStatus.FAILED.value,
                failed_at=datetime.now(UTC),
                errors={"object": "list", "data": [error]},
            )
            .returning(Batch.tenant_id)
        ).first()
        if failed is not None:
            webhook_outbox.record(s, [Event(failed.tenant_id, "batch.failed", batch_id)])


def tell_ended(events: JobEvents, ended: list[tuple[str, int, str]], status: JobStatus) -> None:
    """Abort the lines that were running in the engine, and end every line's event log."""
    code, message = LINE_ERRORS[status.value]
    error = error_object(message, "invalid_request_error", code=code)
    events.request_cancels([job_id for job_id, _, before in ended if before == JobStatus.RUNNING.value])
    events.append_ends([(job_id, end_event(epoch, status.value, error)) for job_id, epoch, _ in ended])


def end_lines(
    db: Database, batch_id: str, status: JobStatus, *, patience_seconds: float = 10.0
) -> list[tuple[str, int, str]]:
    """End every unfinished line of a batch as `status` (cancelled or expired). Running
    lines get a new epoch, so the worker's late write is refused. Returns (id, epoch, status
    before) of each line ended.

    Lines a worker is writing at this moment (a claim, a lease renewal, its results) are
    skipped and taken on the next pass, a few milliseconds later: waiting for their locks
    while holding the others would deadlock with the worker's statement, which locks its
    rows in an order of its own. Lines still unfinished after `patience_seconds` (a lock
    held that long) are left to the lifecycle's `end_left_lines`."""
    code, message = LINE_ERRORS[status.value]
    error = error_body(message, "invalid_request_error", code=code)
    stamp = "cancelled_at" if status == JobStatus.CANCELLED else "expired_at"
    end_free = text(
        f"""
        WITH targets AS (
          SELECT id, status FROM jobs
          WHERE batch_id = :batch AND status IN ('queued', 'running') FOR UPDATE SKIP LOCKED)
        UPDATE jobs SET status = :status, {stamp} = now(), epoch = jobs.epoch + 1,
               error = CAST(:error AS json), lease_owner = NULL, lease_expires_at = NULL
        FROM targets WHERE jobs.id = targets.id
        RETURNING jobs.id, jobs.epoch, targets.status
        """  # noqa: S608 - `stamp` is one of two column names
    )
    params = {"batch": batch_id, "status": status.value, "error": json.dumps(error)}
    ended: list[tuple[str, int, str]] = []
    deadline = time.monotonic() + patience_seconds
    while True:
        with db.session() as s:
            ended += [(r[0], r[1], r[2]) for r in s.execute(end_free, params)]
            left = s.scalar(_UNFINISHED_LINES, {"batch": batch_id})
        if not left:
            return ended
        if time.monotonic() >= deadline:
            log.warning(
                "batch lines still locked; the lifecycle ends them",
                extra={"batch_id": batch_id, "lines_left": left, "lines_ended": len(ended)},
            )
            return ended
        time.sleep(END_LINES_RETRY_SECONDS)
