"""OpenAI Batches on job rows, the use cases: create (its file's lines become jobs with one
INSERT ... SELECT), get, list, cancel, retry. Row transitions are in batch_transitions,
the output and error files in batch_output."""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Any, cast

from sqlalchemy import select, text, update
from sqlalchemy.exc import SQLAlchemyError

from app.db import Database
from app.domain.line_order import LineOrder
from app.domain.metadata import check_metadata
from app.domain.status import BatchStatus, FilePurpose, JobStatus
from app.errors import Conflict, InvalidRequest
from app.events import JobEvents
from app.ids import new_id
from app.models import Batch, File, Job
from app.request_ids import current_request_id
from app.schemas.base import unix_time
from app.schemas.batches import (
    BATCH_ENDPOINTS,
    BatchCreate,
    BatchErrors,
    BatchList,
    BatchObject,
    BatchProgress,
    BatchUsage,
    InputTokensDetails,
    OutputTokensDetails,
    RequestCounts,
)
from app.services.batch_counts import BatchCounts
from app.services.batch_transitions import (
    ACTIVE,
    LINE_SUMS,
    end_lines,
    fail_validating,
    materialize,
    tell_ended,
)
from app.services.budgets import check_batch_tokens
from app.services.idempotency import IdempotencyKey, IdempotencyLocks, find_replay
from app.services.keys import Principal
from app.services.metadata import has_metadata
from app.services.object_inputs import ObjectInputs
from app.services.object_store import ObjectStore, is_object_path
from app.services.ownership import load_owned
from app.services.pagination import check_limit, newest_first, page_fields
from app.services.parsing import parse_model
from app.services.quotas import check_batch_lines

log = logging.getLogger("llmq.batches")

# The first line asking for a priority outside the tenant's band.
_OUT_OF_BAND = text(
    """
    SELECT line_no, p FROM file_lines, LATERAL (SELECT ((raw::json)->'body'->>'priority')::numeric AS p) x
    WHERE file_id = :f AND p IS NOT NULL AND (p < :low OR p > :high) ORDER BY line_no LIMIT 1
    """
)

# BATCH_COUNTS for a page of batches at once, and each batch's model (its first line's).
BATCH_COUNTS_MANY = text(
    "SELECT batch_id, status,"
    + LINE_SUMS
    + "FROM jobs WHERE batch_id = ANY(:batches) GROUP BY batch_id, status"
)
BATCH_MODELS = text(
    "SELECT DISTINCT ON (batch_id) batch_id, model FROM jobs WHERE batch_id = ANY(:batches) "
    "ORDER BY batch_id, line_no"
)


# A batch's completion window: its deadline is `created_at` + window.
WINDOW_UNITS = {"m": 60, "h": 3600, "d": 86400}
MIN_WINDOW_SECONDS = 3600
MAX_WINDOW_SECONDS = 7 * 86400


def window_seconds(window: str) -> int:
    """The completion window in seconds: a whole number of minutes, hours or days (`90m`,
    `24h`, `7d`) from 1 hour to 7 days.

    Raises:
        InvalidRequest: not of that form, or outside the range.
    """
    match = re.fullmatch(r"([1-9][0-9]{0,5})([mhd])", window)
    seconds = int(match.group(1)) * WINDOW_UNITS[match.group(2)] if match else 0
    if not MIN_WINDOW_SECONDS <= seconds <= MAX_WINDOW_SECONDS:
        raise InvalidRequest(
            f"completion_window must be from 1h to 7d, written like 24h, 90m or 2d; got {window!r}",
            param="completion_window",
        )
    return seconds


class BatchService:
    def __init__(
        self,
        db: Database,
        events: JobEvents,
        *,
        locks: IdempotencyLocks | None = None,
        idempotency_ttl_seconds: int = 24 * 3600,
        max_active_lines_per_tenant: int = 0,
        batch_token_budget: int = 0,
        submitted: Callable[[str, str, int], None] | None = None,
        inputs: ObjectInputs | None = None,
        created: Callable[[], None] | None = None,
    ) -> None:
        """`batch_token_budget`: the default per tenant and model (app/services/budgets.py).
        `submitted(model, kind, count)` is told of the lines of each batch created (app/metrics.py).
        `inputs`: reads s3:// inputs and checks s3:// outputs (app/services/object_inputs.py).
        `created()` is called once a batch's lines are jobs (the API wakes the batch feeder)."""
        self._db = db
        self._events = events
        self._inputs = inputs
        self._locks = locks
        self._idempotency_ttl = idempotency_ttl_seconds
        self._max_active_lines = max_active_lines_per_tenant
        self._token_budget = batch_token_budget
        self._submitted = submitted
        self._created = created
        self._counts = BatchCounts()

    # --- create -------------------------------------------------------------------------

    def create(
        self,
        principal: Principal,
        payload: Any,
        *,
        parent: str | None = None,
        idem: IdempotencyKey | None = None,
    ) -> BatchObject:
        """Raises:
        InvalidRequest: bad fields, an endpoint the file's lines do not use, too much metadata.
        InvalidRequest: a line's `priority` is outside the tenant's band.
        NotFound: no such input file for this tenant.
        Conflict / Unprocessable: the idempotency key is in use, or was used with another body.
        RateLimited: the tenant's unfinished batch lines would pass their cap, or its
            enqueued tokens for a model their budget (`token_limit_exceeded`).
        """
        if idem is None or self._locks is None:
            return self._create(principal, payload, parent, None)
        with self._locks.hold(principal.tenant_id, idem):
            with self._db.session() as s:
                found = find_replay(s, Batch, principal.tenant_id, idem, self._idempotency_ttl)
            if found is not None:
                return self.get(principal, found.id)
            return self._create(principal, payload, parent, idem)

    def _create(
        self, principal: Principal, payload: Any, parent: str | None, idem: IdempotencyKey | None
    ) -> BatchObject:
        req = parse_model(BatchCreate, payload)
        if req.endpoint not in BATCH_ENDPOINTS:
            raise InvalidRequest(
                f"endpoint {req.endpoint!r} is not supported ({', '.join(BATCH_ENDPOINTS)})", param="endpoint"
            )
        check_metadata(req.metadata)
        seconds = window_seconds(req.completion_window)
        links = ObjectLinks()
        if req.x_output_data_path is not None:
            output = self.objects().resolve(
                principal.tenant_id, req.x_output_data_path, param="x_output_data_path"
            )
            links = ObjectLinks(output_url=str(output), output_format=OutputFormat.JSONL)
        file_id = req.input_file_id
        if is_object_path(file_id):
            imported = self.inputs().import_jsonl(principal, file_id, param="input_file_id")
            file_id = imported.file.id
            links = replace(links, input_url=str(imported.path))
        return self.open_batch(
            principal,
            BatchSpec(
                file_id=file_id,
                endpoint=req.endpoint,
                completion_window=req.completion_window,
                seconds=seconds,
                metadata=req.metadata,
                output_expires_after=req.output_expires_after.seconds if req.output_expires_after else None,
                links=links,
                line_order=req.x_line_order.value,
            ),
            parent=parent,
            idem=idem,
        )

    def inputs(self) -> ObjectInputs:
        """Raises InvalidRequest when this deployment has no object storage configured."""
        if self._inputs is None:
            raise InvalidRequest(
                "object storage is not configured on this deployment", code="no_object_store"
            )
        return self._inputs

    def objects(self) -> ObjectStore:
        return self.inputs().store

    def open_batch(
        self,
        principal: Principal,
        spec: BatchSpec,
        *,
        parent: str | None = None,
        idem: IdempotencyKey | None = None,
    ) -> BatchObject:
        """A batch over an input file this tenant owns: its lines checked against the
        endpoint, the tenant's priority band, line cap and token budget, then made jobs.

        Raises: as `create`.
        """
        with self._db.session() as s:
            f = load_owned(s, File, spec.file_id, principal.tenant_id, param="input_file_id")
            if f.purpose != FilePurpose.BATCH.value:
                raise InvalidRequest(
                    f"file {f.id} has purpose {f.purpose!r}, not 'batch'", param="input_file_id"
                )
            urls = s.execute(
                text(
                    "SELECT line_no, (raw::json)->>'url' FROM file_lines "
                    "WHERE file_id = :f AND (raw::json)->>'url' <> :u LIMIT 1"
                ),
                {"f": f.id, "u": spec.endpoint},
            ).first()
            if urls is not None:
                raise InvalidRequest(
                    f"line {urls[0]} of the file asks for {urls[1]!r}, "
                    f"not the batch's endpoint {spec.endpoint!r}",
                    param="endpoint",
                )
            band = principal.priority
            # Lines were checked at upload, before any band applied: the band is checked here.
            outside = s.execute(_OUT_OF_BAND, {"f": f.id, "low": band.low, "high": band.high}).first()
            if outside is not None:
                band.resolve(int(outside.p), where=f"line {outside.line_no}: ")
            check_batch_lines(s, principal.tenant_id, f.line_count, self._max_active_lines)
            check_batch_tokens(s, principal.tenant_id, f.id, self._token_budget)
            now = datetime.now(UTC)
            batch = Batch(
                id=new_id("batch"),
                tenant_id=principal.tenant_id,
                endpoint=spec.endpoint,
                input_file_id=f.id,
                completion_window=spec.completion_window,
                status=BatchStatus.VALIDATING.value,
                metadata_=spec.metadata,
                output_expires_after=spec.output_expires_after,
                input_url=spec.links.input_url,
                output_url=spec.links.output_url,
                output_format=spec.links.output_format,
                client_request=spec.links.client_request,
                line_order=spec.line_order,
                total=f.line_count,
                parent_batch_id=parent,
                idempotency_key=idem.key if idem else None,
                request_hash=idem.fingerprint if idem else None,
                created_at=now,
                expires_at=now + timedelta(seconds=spec.seconds),
                request_id=current_request_id(),
            )
            s.add(batch)
        # `validating` is committed on its own, so it is seen while the lines become jobs;
        # a batch left there by a crash is taken up again by the lifecycle. One whose
        # caller is told it failed must not run later: it ends `failed`.
        try:
            materialize(self._db, batch.id)
        except Exception:
            with contextlib.suppress(SQLAlchemyError):
                fail_validating(self._db, batch.id)
            raise
        log.info(
            "batch created", extra={"batch_id": batch.id, "lines": batch.total, "tenant": principal.tenant_id}
        )
        if self._created is not None:
            self._created()
        created = self.get(principal, batch.id)
        if self._submitted is not None and created.model is not None:
            self._submitted(created.model, "batch_line", batch.total)
        return created

    # --- read ---------------------------------------------------------------------------

    def get(self, principal: Principal, batch_id: str) -> BatchObject:
        with self._db.reading() as s:
            batch = load_owned(s, Batch, batch_id, principal.tenant_id)
            counts = self._counts.read(s, batch.id)
            model = s.scalar(select(Job.model).where(Job.batch_id == batch.id).limit(1))
        return to_batch_object(batch, counts, model)

    def list(
        self,
        principal: Principal,
        *,
        after: str | None,
        limit: int,
        metadata: dict[str, str] | None = None,
    ) -> BatchList:
        """Newest first; `metadata`: pairs each listed batch's metadata holds."""
        check_limit(limit, 100)
        q = select(Batch).where(Batch.tenant_id == principal.tenant_id)
        if metadata:
            q = q.where(*has_metadata(Batch.metadata_, metadata))
        with self._db.reading() as s:
            batches, more = newest_first(s, q, Batch.id, after=after, limit=limit)
            page = [b.id for b in batches]
            counts: dict[str, list[Any]] = {i: [] for i in page}
            models: dict[str, str] = {}
            if page:
                for row in s.execute(BATCH_COUNTS_MANY, {"batches": page}):
                    counts[row.batch_id].append(row)
                models = {row.batch_id: row.model for row in s.execute(BATCH_MODELS, {"batches": page})}
        data = [to_batch_object(b, counts[b.id], models.get(b.id)) for b in batches]
        return BatchList(data=data, **page_fields(data, more))

    # --- cancel and retry ---------------------------------------------------------------

    def cancel(self, principal: Principal, batch_id: str) -> BatchObject:
        """`cancelling` now; the lines not finished are cancelled (running ones fenced off
        and aborted in the engine), finished ones stay in the output; the worker's
        finalizer makes the batch `cancelled`.

        Raises:
            NotFound: no such batch for this tenant.
            Conflict: the batch already ended.
        """
        now = datetime.now(UTC)
        with self._db.session() as s:
            batch = load_owned(s, Batch, batch_id, principal.tenant_id)
            already = batch.status in (BatchStatus.CANCELLING.value, BatchStatus.CANCELLED.value)
            if not already and batch.status not in ACTIVE:
                raise Conflict(
                    f"batch {batch_id} already {batch.status}", param="batch_id", code="batch_not_cancellable"
                )
            if not already:
                s.execute(
                    update(Batch)
                    .where(Batch.id == batch_id)
                    .values(status=BatchStatus.CANCELLING.value, cancelling_at=now)
                )
        if already:
            return self.get(principal, batch_id)
        ended = end_lines(self._db, batch_id, JobStatus.CANCELLED)
        tell_ended(self._events, ended, JobStatus.CANCELLED)
        log.info("batch cancelling", extra={"batch_id": batch_id, "lines_cancelled": len(ended)})
        return self.get(principal, batch_id)

    def retry(self, principal: Principal, batch_id: str) -> BatchObject:
        """A child batch of the lines that failed, were cancelled or expired (extension).

        Raises:
            NotFound: no such batch for this tenant.
            Conflict: the batch is still running, nothing in it failed, or its input file
                is gone (expired or deleted).
        """
        with self._db.session() as s:
            batch = load_owned(s, Batch, batch_id, principal.tenant_id)
            if batch.status in ACTIVE or batch.status == BatchStatus.FINALIZING.value:
                raise Conflict(
                    f"batch {batch_id} is still {batch.status}", param="batch_id", code="batch_running"
                )
            if s.get(File, batch.input_file_id) is None:
                raise Conflict(
                    f"batch {batch_id}'s input file {batch.input_file_id} has expired or was deleted",
                    param="batch_id",
                    code="input_file_gone",
                )
            file_id = new_id("file")
            s.add(
                File(
                    id=file_id,
                    tenant_id=principal.tenant_id,
                    purpose=FilePurpose.BATCH.value,
                    filename=f"retry-of-{batch_id}.jsonl",
                    bytes=0,
                    line_count=0,
                )
            )
            s.flush()
            copied = cast(
                Any,
                s.execute(
                    text(
                        """
                    INSERT INTO file_lines (file_id, line_no, custom_id, raw, tokens)
                    SELECT :new, row_number() OVER (ORDER BY fl.line_no), fl.custom_id, fl.raw, fl.tokens
                    FROM file_lines fl JOIN jobs j ON j.batch_id = :batch AND j.line_no = fl.line_no
                    WHERE fl.file_id = :old AND j.status IN ('failed', 'cancelled', 'expired')
                    """
                    ),
                    {"new": file_id, "batch": batch_id, "old": batch.input_file_id},
                ),
            ).rowcount
            if not copied:
                raise Conflict(
                    f"batch {batch_id} has no failed, cancelled or expired lines",
                    param="batch_id",
                    code="nothing_to_retry",
                )
            s.execute(
                text(
                    "UPDATE files SET line_count = :n, bytes = "
                    "(SELECT coalesce(sum(octet_length(raw) + 1), 0) FROM file_lines WHERE file_id = :new) "
                    "WHERE id = :new"
                ),
                {"n": copied, "new": file_id},
            )
        # The child runs as long as its parent was given (an llm-engine batch's window is
        # its max_runtime_sec, which need not be a whole number of minutes).
        return self.open_batch(
            principal,
            BatchSpec(
                file_id=file_id,
                endpoint=batch.endpoint,
                completion_window=batch.completion_window,
                seconds=int((batch.expires_at - batch.created_at).total_seconds()),
                metadata=batch.metadata_,
                output_expires_after=batch.output_expires_after,
                line_order=batch.line_order,
            ),
            parent=batch_id,
        )


class OutputFormat(StrEnum):
    """How a batch's output is written to object storage (app/services/batch_export.py)."""

    JSONL = "jsonl"  # OpenAI output lines, every line in input order
    JSON_ARRAY = "json_array"  # llm-engine's: one JSON array, a body or an error per line


@dataclass(frozen=True)
class ObjectLinks:
    """A batch's ties to object storage, and what an llm-engine client sent beside its lines."""

    input_url: str | None = None
    output_url: str | None = None
    output_format: str | None = None
    client_request: dict[str, Any] | None = None


@dataclass(frozen=True)
class BatchSpec:
    """A batch to open over an input file: `seconds` from now is its deadline."""

    file_id: str
    endpoint: str
    completion_window: str
    seconds: int
    metadata: dict[str, str] | None = None
    output_expires_after: int | None = None
    links: ObjectLinks = field(default_factory=ObjectLinks)
    line_order: str = LineOrder.PREFIX.value  # app/domain/line_order.py


def to_batch_object(batch: Batch, counts: Any, model: str | None) -> BatchObject:
    by_status = {row.status: row for row in counts}
    progress = BatchProgress(**{status: row.n for status, row in by_status.items()})
    done = progress.succeeded + progress.failed + progress.cancelled + progress.expired
    prompt = int(sum(r.prompt for r in counts))
    completion = int(sum(r.completion for r in counts))
    cached = int(sum(r.cached for r in counts))
    usage = (
        BatchUsage(
            input_tokens=prompt,
            output_tokens=completion,
            total_tokens=prompt + completion,
            input_tokens_details=InputTokensDetails(cached_tokens=cached),
            output_tokens_details=OutputTokensDetails(),
        )
        if done
        else None
    )
    rate = eta = None
    if batch.in_progress_at is not None and done:
        end = batch.completed_at or batch.cancelled_at or batch.expired_at or datetime.now(UTC)
        elapsed = max((end - batch.in_progress_at).total_seconds(), 1e-3)
        rate = round(completion / elapsed, 1)
        if batch.status == BatchStatus.IN_PROGRESS.value:
            eta = round(elapsed / done * (batch.total - done), 1)
    return BatchObject(
        id=batch.id,
        endpoint=batch.endpoint,
        errors=BatchErrors.model_validate(batch.errors) if batch.errors else None,
        input_file_id=batch.input_file_id,
        completion_window=batch.completion_window,
        status=batch.status,
        output_file_id=batch.output_file_id,
        error_file_id=batch.error_file_id,
        created_at=unix_time(batch.created_at) or 0,
        in_progress_at=unix_time(batch.in_progress_at),
        expires_at=unix_time(batch.expires_at),
        finalizing_at=unix_time(batch.finalizing_at),
        completed_at=unix_time(batch.completed_at),
        failed_at=unix_time(batch.failed_at),
        expired_at=unix_time(batch.expired_at),
        cancelling_at=unix_time(batch.cancelling_at),
        cancelled_at=unix_time(batch.cancelled_at),
        request_counts=RequestCounts(
            total=batch.total, completed=progress.succeeded, failed=done - progress.succeeded
        ),
        metadata=batch.metadata_,
        usage=usage,
        model=model,
        x_progress=progress,
        x_output_tokens_per_second=rate,
        x_estimated_seconds_left=eta,
        x_parent_batch_id=batch.parent_batch_id,
        x_request_id=batch.request_id,
        x_input_data_path=batch.input_url,
        x_output_data_path=batch.output_url,
        x_output_exported_at=unix_time(batch.exported_at),
        x_output_export_error=batch.export_error,
        x_line_order=LineOrder(batch.line_order),
    )
