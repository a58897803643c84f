"""Single jobs: submit, read, list, cancel. Owns its transactions; enqueues after commit."""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, NamedTuple

from sqlalchemy import inspect, select, text, update
from sqlalchemy.orm import defer

from app.db import Database
from app.domain.status import JobKind, JobStatus
from app.errors import Conflict, InvalidRequest
from app.events import JobEvents, end_event
from app.ids import new_id
from app.models import Job
from app.queue import JobQueue
from app.request_ids import current_request_id
from app.schemas.base import unix_time
from app.schemas.chat import ChatCompletionV2Request
from app.schemas.jobs import JobList, JobObject, JobRequestObject
from app.schemas.text_completion import JobRequest
from app.services.contract import RequestPolicy
from app.services.idempotency import IdempotencyKey, IdempotencyLocks, find_replay
from app.services.keys import Principal
from app.services.metadata import has_metadata
from app.services.ownership import load_owned, not_owned
from app.services.pagination import check_limit, newest_first, page_fields
from app.services.parsing import parse_model
from app.services.quotas import insert_single_job
from app.services.webhook_outbox import record_jobs

# Each attribute's column name (`metadata_` is `metadata`).
_COLUMN_OF = {attr.key: attr.columns[0].name for attr in inspect(Job).column_attrs}

log = logging.getLogger("llmq.jobs")

MAX_PAGE = 100
# What a job object leaves out: the request and the recorded stream (every chunk of a long
# answer), not read from Postgres for a poll or a listing; touching them is an error.
JOB_OBJECT_ONLY = (defer(Job.request, raiseload=True), defer(Job.events, raiseload=True))


class JobRow(NamedTuple):
    """What a job object shows of a job's row, by the Job attributes' names (`to_job_object`
    takes it as it takes a Job): read by `_READ_JOB`."""

    id: str
    status: str
    model: str
    priority: int
    attempts: int
    epoch: int
    lease_owner: str | None
    finished_by: str | None
    created_at: datetime
    started_at: datetime | None
    succeeded_at: datetime | None
    failed_at: datetime | None
    cancelled_at: datetime | None
    expired_at: datetime | None
    cancel_requested_at: datetime | None
    batch_id: str | None
    custom_id: str | None
    response: dict[str, Any] | None
    error: dict[str, Any] | None
    usage: dict[str, Any] | None
    generation_stats: dict[str, Any] | None
    power_usage: dict[str, Any] | None
    metadata_: dict[str, Any] | None
    request_id: str | None
    queue_wait_seconds: float | None
    ttft_seconds: float | None
    e2e_seconds: float | None


# A tenant's job by its id, JobRow's columns: the read of every poll (`GET /v2/jobs/<id>`)
# and of every synchronous chat completion's answer. Run on the pooled connection's cursor
# (`Database.returning`), not as an ORM select: 0.79 -> 0.22 ms of the API's CPU a read.
_JOB_ROW_COLUMNS = ", ".join('"' + _COLUMN_OF[name] + '"' for name in JobRow._fields)
_READ_JOB = text(
    f"SELECT {_JOB_ROW_COLUMNS} FROM jobs WHERE id = :id AND tenant_id = :tenant_id"  # noqa: S608 - the model's names
)


# A tenant's job's status alone: what a wait for a job's end asks (a synchronous
# completion's, as it starts and again when told of the end; a cancel's), where the whole
# row would carry its request and its recorded stream, every chunk parsed, to be thrown away.
_JOB_STATUS = text("SELECT status FROM jobs WHERE id = :id AND tenant_id = :tenant_id")


def job_status(db: Database, job_id: str, tenant_id: str) -> str | None:
    """`job_id`'s status, None when `tenant_id` has no such job."""
    rows = db.returning(_JOB_STATUS, {"id": job_id, "tenant_id": tenant_id})
    return str(rows[0][0]) if rows else None


def to_job_object(job: Job | JobRow) -> JobObject:
    return JobObject(
        id=job.id,
        status=JobStatus(job.status),
        model=job.model,
        priority=job.priority,
        attempts=job.attempts,
        epoch=job.epoch,
        lease_owner=job.lease_owner,
        finished_by=job.finished_by,
        created_at=unix_time(job.created_at) or 0,
        started_at=unix_time(job.started_at),
        succeeded_at=unix_time(job.succeeded_at),
        failed_at=unix_time(job.failed_at),
        cancelled_at=unix_time(job.cancelled_at),
        expired_at=unix_time(job.expired_at),
        cancel_requested_at=unix_time(job.cancel_requested_at),
        batch_id=job.batch_id,
        custom_id=job.custom_id,
        response=job.response,
        error=(job.error or {}).get("error") if job.error else None,
        usage=job.usage,
        generation_stats=job.generation_stats,
        power_usage=job.power_usage,
        metadata=job.metadata_,
        request_id=job.request_id,
        queue_wait_seconds=job.queue_wait_seconds,
        ttft_seconds=job.ttft_seconds,
        e2e_seconds=job.e2e_seconds,
    )


class JobService:
    def __init__(
        self,
        db: Database,
        queue: JobQueue,
        events: JobEvents,
        policy: RequestPolicy,
        *,
        cancel_wait_seconds: float,
        locks: IdempotencyLocks | None = None,
        idempotency_ttl_seconds: int = 24 * 3600,
        max_active_per_tenant: int = 0,
        submitted: Callable[[str, str, int], None] | None = None,
    ) -> None:
        """`submitted(model, kind, count)` is told of each job accepted (app/metrics.py)."""
        self._db = db
        self._queue = queue
        self._events = events
        self._policy = policy
        self._cancel_wait = cancel_wait_seconds
        self._locks = locks
        self._idempotency_ttl = idempotency_ttl_seconds
        self._max_active = max_active_per_tenant
        self._submitted = submitted

    def validate(self, payload: Any, *, streaming: bool = False) -> ChatCompletionV2Request:
        """Raises:
        InvalidRequest / Unsupported / NotFound: the request cannot run here.
        """
        request = parse_model(ChatCompletionV2Request, payload)
        self._policy.check(request, streaming=streaming)
        return request

    def submit(self, principal: Principal, payload: Any, idem: IdempotencyKey | None = None) -> JobObject:
        """`POST /v2/jobs`: validate, store, enqueue."""
        return self.submit_request(principal, self.validate(payload), idem=idem)

    def submit_request(
        self,
        principal: Principal,
        request: JobRequest,
        *,
        kind: JobKind = JobKind.CHAT,
        idem: IdempotencyKey | None = None,
    ) -> JobObject:
        """Store, then enqueue one validated job (`kind` says which request it is: a chat
        completion, or a text completion for `JobKind.COMPLETION`). The job is durable before any message
        names it; if Redis is down the sweeper sends the message once it is back. With an
        idempotency key seen before (same body), the job it made is returned instead.

        Raises:
            Conflict: the same key is being handled right now.
            Unprocessable: the key was used with another body.
            RateLimited: the tenant has too many single jobs queued or running.
            InvalidRequest: `priority` is outside the tenant's band.
        """
        if idem is None or self._locks is None:
            return self._insert(principal, request, kind, None)
        with self._locks.hold(principal.tenant_id, idem):
            existing = self._replay(principal, idem)
            return existing if existing is not None else self._insert(principal, request, kind, idem)

    def _replay(self, principal: Principal, idem: IdempotencyKey) -> JobObject | None:
        with self._db.session() as s:
            job = find_replay(s, Job, principal.tenant_id, idem, self._idempotency_ttl)
            return to_job_object(job) if job is not None else None

    def _insert(
        self,
        principal: Principal,
        request: JobRequest,
        kind: JobKind,
        idem: IdempotencyKey | None,
    ) -> JobObject:
        # The stored request carries the priority it runs at, so the worker (and the engine)
        # see the same value as the broker.
        priority = principal.priority.resolve(request.priority)
        if request.effective_priority() != priority:
            request = request.model_copy(update={"priority": priority})
        now = datetime.now(UTC)
        values: dict[str, Any] = {
            "id": new_id("job"),
            "tenant_id": principal.tenant_id,
            "kind": kind.value,
            "status": JobStatus.QUEUED.value,
            "priority": request.effective_priority(),
            "model": request.model,
            "request": request.model_dump(mode="json", exclude_unset=True, by_alias=True),
            "metadata_": request.metadata or None,
            "attempts": 0,
            "epoch": 0,
            "created_at": now,
            # The message is sent right after commit; if that send is lost, the sweeper
            # finds no marker once the grace period has passed and sends it again
            # (app/liveness.py, rows 3 and 4).
            "enqueued_at": now,
            "idempotency_key": idem.key if idem else None,
            "request_hash": idem.fingerprint if idem else None,
            "request_id": current_request_id(),
        }
        row = {_COLUMN_OF[k]: v for k, v in values.items()}
        # Counted and inserted in one transaction under the tenant's lock: concurrent submits
        # cannot all see the last free place (app/services/quotas.py). One statement built
        # once, its values as parameters: the ORM unit of work (about a millisecond per job)
        # and a statement built per call are both skipped.
        insert_single_job(self._db, principal.tenant_id, self._max_active, row)
        # The answer's row as the insert wrote it (columns it did not name are NULL): a plain
        # tuple, where an ORM Job built from the values cost 40-80 us more a submit.
        job = JobRow._make(values.get(name) for name in JobRow._fields)
        try:
            self._queue.enqueue(job.id, job.model, job.priority, request_id=job.request_id)
        except Exception as exc:  # noqa: BLE001 - any broker failure leaves the job to the sweeper
            log.warning(
                "enqueue failed, the sweeper will resend", extra={"job_id": job.id, "error": str(exc)}
            )
        if self._submitted is not None:
            self._submitted(job.model, "single", 1)
        log.info("job accepted", extra={"job_id": job.id, "tenant": principal.tenant_id})
        return to_job_object(job)

    def get(self, principal: Principal, job_id: str) -> JobObject:
        """Raises:
        NotFound: no such job for this tenant (another tenant's job included).
        """
        rows = self._db.returning(_READ_JOB, {"id": job_id, "tenant_id": principal.tenant_id})
        if not rows:
            raise not_owned(Job, job_id)
        return to_job_object(JobRow(*rows[0]))

    def request_of(self, principal: Principal, job_id: str) -> JobRequestObject:
        """The request the job runs (`GET /v2/jobs/<id>/request`).

        Raises:
            NotFound: no such job for this tenant.
        """
        with self._db.reading() as s:
            job = load_owned(s, Job, job_id, principal.tenant_id)
            return JobRequestObject(id=job.id, body=job.request or None)

    def list(
        self,
        principal: Principal,
        *,
        status: str | None = None,
        batch_id: str | None = None,
        after: str | None = None,
        limit: int = 20,
        metadata: dict[str, str] | None = None,
    ) -> JobList:
        """Newest first; `after` is the last id of the previous page; `metadata`: pairs each
        listed job's metadata holds (app/domain/metadata.py's `metadata_filter`)."""
        check_limit(limit, MAX_PAGE)
        if status is not None and status not in {s.value for s in JobStatus}:
            raise InvalidRequest(f"unknown status {status!r}", param="status")
        q = select(Job).options(*JOB_OBJECT_ONLY).where(Job.tenant_id == principal.tenant_id)
        if status:
            q = q.where(Job.status == status)
        if batch_id:
            q = q.where(Job.batch_id == batch_id)
        if metadata:
            q = q.where(*has_metadata(Job.metadata_, metadata))
        with self._db.reading() as s:
            rows, more = newest_first(s, q, Job.id, after=after, limit=limit)
        page = [to_job_object(j) for j in rows]
        return JobList(data=page, **page_fields(page, more))

    def cancel(self, principal: Principal, job_id: str) -> JobObject:
        """Cancel a queued job at once; ask the worker to abort a running one and wait a
        little for it to record the partial text.

        Raises:
            NotFound: no such job for this tenant.
            Conflict: the job already succeeded, failed or expired.
        """
        now = datetime.now(UTC)
        with self._db.session() as s:
            job = load_owned(s, Job, job_id, principal.tenant_id)
            status = JobStatus(job.status)
            if status == JobStatus.CANCELLED:
                return to_job_object(job)
            if status.terminal:
                raise Conflict(
                    f"job {job_id} already {status.value}; only queued or running jobs can be cancelled",
                    param="job_id",
                    code="job_not_cancellable",
                )
            was_queued = s.execute(
                update(Job)
                .where(Job.id == job_id, Job.status == JobStatus.QUEUED.value)
                .values(status=JobStatus.CANCELLED.value, cancelled_at=now, cancel_requested_at=now)
                .returning(Job.epoch)
            ).first()
            if was_queued is not None:
                record_jobs(s, [(job.tenant_id, job_id, JobStatus.CANCELLED.value, job.batch_id)])
            s.execute(
                update(Job)
                .where(Job.id == job_id, Job.status == JobStatus.RUNNING.value)
                .values(cancel_requested_at=now)
            )
        if was_queued is not None:
            # Nobody runs it: end its event log here, so subscribers are told.
            self._events.append_end(job_id, end_event(was_queued.epoch, JobStatus.CANCELLED.value, None))
        else:
            self._events.request_cancel(job_id)
        self._events.wait_for_end(
            job_id, lambda: self._is_terminal(job_id, principal.tenant_id), self._cancel_wait
        )
        log.info("job cancel requested", extra={"job_id": job_id, "tenant": principal.tenant_id})
        return self.get(principal, job_id)

    def _is_terminal(self, job_id: str, tenant_id: str) -> bool:
        status = job_status(self._db, job_id, tenant_id)
        return status is None or JobStatus(status).terminal
