"""Postgres tables, typed with SQLAlchemy 2.0. Postgres is the source of truth."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    DateTime,
    Double,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    func,
    literal_column,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from app.domain.line_order import LineOrder
from app.domain.status import JobKind, JobStatus

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


# When a job ended: the timestamp of its terminal status (GREATEST skips NULLs). The same
# text in the index below and in the queries that use it, so the planner matches them.
JOB_ENDED_AT = "GREATEST(succeeded_at, failed_at, cancelled_at, expired_at)"
TERMINAL_STATUSES = "('succeeded','failed','cancelled','expired')"
# The size up to which Postgres keeps a jobs row whole in its page, uncompressed: the most
# that lets two rows share an 8 KB page (Postgres's default, 2032, lets four).
TOAST_TUPLE_TARGET = 4080


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {dict[str, Any]: JSONB, datetime: DateTime(timezone=True)}


class Tenant(Base):
    __tablename__ = "tenants"
    __table_args__ = (
        CheckConstraint("priority_min <= priority_max", name="priority_band"),
        CheckConstraint("share_weight > 0", name="share_weight_positive"),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    created_at: Mapped[datetime] = mapped_column(server_default=func.now())
    # The `priority` values this tenant's requests may ask for (app/services/priority.py).
    priority_min: Mapped[int] = mapped_column(Integer, server_default="0")
    priority_max: Mapped[int] = mapped_column(Integer, server_default="100")
    # This tenant's weight in the feeder's fair share of batch dispatch (app/services/fair_share.py).
    share_weight: Mapped[float] = mapped_column(Float, server_default="1")
    # Tokens this tenant may have enqueued per model in unfinished batches (app/services/
    # budgets.py): None follows LLMQ_BATCH_TOKEN_BUDGET, 0 is no limit.
    batch_token_budget: Mapped[int | None] = mapped_column(BigInteger)


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    # sha256 of the whole key; the key itself is never stored.
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    # First characters of the key, enough for a human to tell keys apart in `keys list`.
    prefix: Mapped[str] = mapped_column(String(16))
    name: Mapped[str | None] = mapped_column(String(128))
    created_at: Mapped[datetime] = mapped_column(server_default=func.now())
    revoked_at: Mapped[datetime | None]


class Job(Base):
    """One chat completion request, from acceptance to its single result."""

    __tablename__ = "jobs"
    __table_args__ = (
        CheckConstraint(
            "status IN ('queued','running','succeeded','failed','cancelled','expired')",
            name="status_valid",
        ),
        # Unique over the rows they constrain only (migration 0024): a job without an
        # idempotency key, or not a batch line, has no entry to write in them at each of
        # its writes (NULLs never conflict in a unique index anyway).
        Index(
            "uq_jobs_tenant_idempotency",
            "tenant_id",
            "idempotency_key",
            unique=True,
            postgresql_where=text("idempotency_key IS NOT NULL"),
        ),
        Index(
            "uq_jobs_batch_line",
            "batch_id",
            "line_no",
            unique=True,
            postgresql_where=text("batch_id IS NOT NULL"),
        ),
        Index("ix_jobs_tenant_id_id", "tenant_id", "id"),
        Index(
            "ix_jobs_active",
            "status",
            "model",
            postgresql_where=text("status IN ('queued','running')"),
        ),
        # The batch feeder's queue: lines not yet sent to the broker, per tenant, in the
        # order they go.
        Index(
            "ix_jobs_undispatched",
            "model",
            "tenant_id",
            "priority",
            "deadline_at",
            "batch_id",
            "prefix_key",
            "line_no",
            postgresql_where=text("status = 'queued' AND batch_id IS NOT NULL AND enqueued_at IS NULL"),
        ),
        # Single jobs queued or running per tenant: what the concurrency cap counts.
        Index(
            "ix_jobs_tenant_active",
            "tenant_id",
            postgresql_where=text("status IN ('queued','running') AND batch_id IS NULL"),
        ),
        # Unfinished batch lines per tenant: what the batch-line cap counts.
        Index(
            "ix_jobs_tenant_active_lines",
            "tenant_id",
            postgresql_where=text("status IN ('queued','running') AND batch_id IS NOT NULL"),
        ),
        # `?metadata[key]=value` filters: `metadata::jsonb @> {...}` (app/domain/metadata.py).
        Index(
            "ix_jobs_metadata",
            literal_column("(metadata::jsonb)").label("metadata_jsonb"),
            postgresql_using="gin",
            postgresql_ops={"metadata_jsonb": "jsonb_path_ops"},
            postgresql_where=text("metadata IS NOT NULL"),
        ),
        # Batch lines out with the broker or running: what the feeder's window counts.
        Index(
            "ix_jobs_dispatched",
            "model",
            postgresql_where=text(
                "batch_id IS NOT NULL AND "
                "(status = 'running' OR (status = 'queued' AND enqueued_at IS NOT NULL))"
            ),
        ),
        # A batch's ended lines in the order they ended: `/v1/batches/<id>/results`.
        Index(
            "ix_jobs_batch_finished",
            "batch_id",
            "finished_xid",
            "line_no",
            postgresql_where=text("finished_xid IS NOT NULL"),
        ),
        # A batch's running lines: counted on every `GET /v1/batches/<id>` (batch_counts.py).
        Index("ix_jobs_batch_running", "batch_id", postgresql_where=text("status = 'running'")),
        # A tenant's jobs by the time they ended: `/v2/throughput` (app/services/throughput.py).
        Index(
            "ix_jobs_tenant_ended",
            "tenant_id",
            literal_column(JOB_ENDED_AT).label("ended_at"),
            postgresql_where=text(f"status IN {TERMINAL_STATUSES}"),
        ),
        # A finished row of up to about 4 KB (a short completion's response and events)
        # stays whole in its page: past Postgres's default of 2 KB each result write tried
        # to compress it and moved its events to the TOAST table and its index (0023).
        {"postgresql_with": {"toast_tuple_target": TOAST_TUPLE_TARGET}},
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    kind: Mapped[str] = mapped_column(String(16), server_default=JobKind.CHAT.value)
    status: Mapped[str] = mapped_column(String(16), server_default=JobStatus.QUEUED.value)
    priority: Mapped[int] = mapped_column(Integer, server_default="0")
    model: Mapped[str] = mapped_column(String(256))
    # Documents holding user or model text are `json`, which keeps text exactly as given:
    # `jsonb` cannot store U+0000, and a model can generate it.
    request: Mapped[dict[str, Any]] = mapped_column(JSON)
    response: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    error: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    usage: Mapped[dict[str, Any] | None]
    generation_stats: Mapped[dict[str, Any] | None]
    power_usage: Mapped[dict[str, Any] | None]
    metadata_: Mapped[dict[str, Any] | None] = mapped_column("metadata", JSON)
    # The stream's events (chunks, then `end`), kept for replay once Redis has let them go.
    events: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON)

    # Delivery and fencing: every write after the claim says WHERE epoch = :mine.
    attempts: Mapped[int] = mapped_column(Integer, server_default="0")
    epoch: Mapped[int] = mapped_column(BigInteger, server_default="0")
    lease_owner: Mapped[str | None] = mapped_column(String(256))
    # The worker whose write ended the job (with the epoch it held, the only one allowed).
    finished_by: Mapped[str | None] = mapped_column(String(256))
    lease_expires_at: Mapped[datetime | None]
    enqueued_at: Mapped[datetime | None]
    cancel_requested_at: Mapped[datetime | None]

    # One timestamp per state the job passed through.
    created_at: Mapped[datetime] = mapped_column(server_default=func.now())
    started_at: Mapped[datetime | None]
    succeeded_at: Mapped[datetime | None]
    failed_at: Mapped[datetime | None]
    cancelled_at: Mapped[datetime | None]
    expired_at: Mapped[datetime | None]

    idempotency_key: Mapped[str | None] = mapped_column(String(256))
    request_hash: Mapped[str | None] = mapped_column(String(64))

    # Set when the job is one line of a batch.
    batch_id: Mapped[str | None] = mapped_column(String(40))
    # The batch's deadline (created_at + completion window): the feeder sends a tenant's
    # lines earliest deadline first.
    deadline_at: Mapped[datetime | None]
    custom_id: Mapped[str | None] = mapped_column(Text)
    line_no: Mapped[int | None] = mapped_column(Integer)
    # Lines of a batch with equal keys begin with the same prompt prefix; the feeder sends
    # them together (app/domain/line_order.py). None: the batch keeps input order.
    prefix_key: Mapped[str | None] = mapped_column(Text)
    # A batch line's tokens against its tenant's batch token budget while it is unfinished:
    # prompt tokens plus the completion tokens it may generate (app/services/budgets.py).
    budget_tokens: Mapped[int | None] = mapped_column(Integer)
    # The transaction (xid8) that ended the batch line, set by the trigger of migration
    # 20261201_0012 (0 for lines that ended before it): app/services/results.py.
    finished_xid: Mapped[int | None] = mapped_column(BigInteger)
    # The X-Request-ID of the request that created the job (a batch line: its batch's).
    request_id: Mapped[str | None] = mapped_column(String(128))
    # Seconds, written with the result by the worker that ended the job (worker/metrics.py
    # observes the same figures): from creation to its first claim; from its submission to
    # the engine to its first token (null without one); from creation to its end.
    queue_wait_seconds: Mapped[float | None] = mapped_column(Double)
    ttft_seconds: Mapped[float | None] = mapped_column(Double)
    e2e_seconds: Mapped[float | None] = mapped_column(Double)


class File(Base):
    """An uploaded input file (its lines in `file_lines`), or a batch's output or error file,
    whose content is generated from the batch's job rows when read."""

    __tablename__ = "files"
    __table_args__ = (
        Index("ix_files_tenant_id_id", "tenant_id", "id"),
        Index("ix_files_expires_at", "expires_at", postgresql_where=text("expires_at IS NOT NULL")),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    purpose: Mapped[str] = mapped_column(String(32))
    filename: Mapped[str] = mapped_column(Text)
    bytes: Mapped[int] = mapped_column(BigInteger)
    line_count: Mapped[int] = mapped_column(Integer, server_default="0")
    created_at: Mapped[datetime] = mapped_column(server_default=func.now())
    # Set on output files: which batch's rows, and which of them ("output" or "errors").
    batch_id: Mapped[str | None] = mapped_column(String(40))
    batch_part: Mapped[str | None] = mapped_column(String(16))
    # When the file is deleted (OpenAI's `expires_after`; app/services/expiry.py); None: kept.
    expires_at: Mapped[datetime | None]


class FileLine(Base):
    """One line of an input file, as uploaded (after validation). Written only with its
    file's row, in one transaction; deleted with it by the `files_delete_lines` trigger
    (migration 0022: a foreign key was checked once a line, after an upload's COPY)."""

    __tablename__ = "file_lines"

    file_id: Mapped[str] = mapped_column(String(40), primary_key=True)
    line_no: Mapped[int] = mapped_column(Integer, primary_key=True)
    custom_id: Mapped[str] = mapped_column(Text)
    raw: Mapped[str] = mapped_column(Text)
    # The line's figure against the batch token budget, counted at upload (budgets.py).
    tokens: Mapped[int | None] = mapped_column(Integer)


class Batch(Base):
    __tablename__ = "batches"
    __table_args__ = (
        UniqueConstraint("tenant_id", "idempotency_key", name="uq_batches_tenant_idempotency"),
        Index("ix_batches_tenant_id_id", "tenant_id", "id"),
        Index(
            "ix_batches_active",
            "status",
            postgresql_where=text("status IN ('validating','in_progress','cancelling','finalizing')"),
        ),
        Index(
            "ix_batches_export_due",
            "id",
            postgresql_where=text("output_url IS NOT NULL AND exported_at IS NULL AND export_error IS NULL"),
        ),
        Index(
            "ix_batches_metadata",
            literal_column("(metadata::jsonb)").label("metadata_jsonb"),
            postgresql_using="gin",
            postgresql_ops={"metadata_jsonb": "jsonb_path_ops"},
            postgresql_where=text("metadata IS NOT NULL"),
        ),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    endpoint: Mapped[str] = mapped_column(String(64))
    input_file_id: Mapped[str] = mapped_column(String(40))
    completion_window: Mapped[str] = mapped_column(String(16))
    status: Mapped[str] = mapped_column(String(16))
    metadata_: Mapped[dict[str, Any] | None] = mapped_column("metadata", JSON)
    errors: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    output_file_id: Mapped[str | None] = mapped_column(String(40))
    error_file_id: Mapped[str | None] = mapped_column(String(40))
    total: Mapped[int] = mapped_column(Integer, server_default="0")
    usage: Mapped[dict[str, Any] | None]
    parent_batch_id: Mapped[str | None] = mapped_column(String(40))
    idempotency_key: Mapped[str | None] = mapped_column(String(256))
    request_hash: Mapped[str | None] = mapped_column(String(64))
    # OpenAI's `output_expires_after.seconds`: the output and error files expire this long
    # after they are made, and the lines' texts with them. None: kept.
    output_expires_after: Mapped[int | None] = mapped_column(Integer)
    # The order its lines are sent in: a LineOrder (app/domain/line_order.py).
    line_order: Mapped[str] = mapped_column(String(16), server_default=LineOrder.PREFIX.value)
    created_at: Mapped[datetime] = mapped_column(server_default=func.now())
    expires_at: Mapped[datetime]
    in_progress_at: Mapped[datetime | None]
    finalizing_at: Mapped[datetime | None]
    completed_at: Mapped[datetime | None]
    failed_at: Mapped[datetime | None]
    expired_at: Mapped[datetime | None]
    cancelling_at: Mapped[datetime | None]
    cancelled_at: Mapped[datetime | None]
    # The X-Request-ID of the request that created the batch; its lines carry it too.
    request_id: Mapped[str | None] = mapped_column(String(128))
    # Object storage (app/services/object_store.py): the s3:// object the lines were read
    # from; where the output is exported when the batch ends, and in which format
    # (app/services/batch_export.py); how that export ended, and a worker's claim on it.
    input_url: Mapped[str | None] = mapped_column(Text)
    output_url: Mapped[str | None] = mapped_column(Text)
    output_format: Mapped[str | None] = mapped_column(String(16))
    exported_at: Mapped[datetime | None]
    export_error: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    export_lease_until: Mapped[datetime | None]
    # What an llm-engine client sent beside its lines (model_config, priority), given back.
    client_request: Mapped[dict[str, Any] | None] = mapped_column(JSON)


class WebhookEndpoint(Base):
    """Where a tenant wants its events sent, and the secret they are signed with. The
    secret is kept as given (it must be recovered to sign; see docs/API.md)."""

    __tablename__ = "webhook_endpoints"
    __table_args__ = (Index("ix_webhook_endpoints_tenant_id_id", "tenant_id", "id"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    url: Mapped[str] = mapped_column(Text)
    name: Mapped[str] = mapped_column(String(256), server_default="")
    event_types: Mapped[list[str]] = mapped_column(ARRAY(String(64)))
    secret: Mapped[str] = mapped_column(String(128))
    # After a rotation that keeps the old secret for a while: it signs too until then.
    previous_secret: Mapped[str | None] = mapped_column(String(128))
    previous_secret_expires_at: Mapped[datetime | None]
    created_at: Mapped[datetime] = mapped_column(server_default=func.now())
    updated_at: Mapped[datetime] = mapped_column(server_default=func.now())


class WebhookDelivery(Base):
    """The outbox: one event for one endpoint, written in the transaction of the state
    change that caused it (app/services/webhook_outbox.py), then sent at least once."""

    __tablename__ = "webhook_deliveries"
    __table_args__ = (
        CheckConstraint("status IN ('pending','delivered','failed')", name="status_valid"),
        # The deliverer's queue: what is due next.
        Index(
            "ix_webhook_deliveries_due",
            "next_attempt_at",
            postgresql_where=text("status = 'pending'"),
        ),
    )

    endpoint_id: Mapped[str] = mapped_column(
        ForeignKey("webhook_endpoints.id", ondelete="CASCADE"), primary_key=True
    )
    # The `webhook-id` header and the body's `id`: the same on every attempt and endpoint.
    event_id: Mapped[str] = mapped_column(String(40), primary_key=True)
    type: Mapped[str] = mapped_column(String(64))
    subject_id: Mapped[str] = mapped_column(String(40))
    status: Mapped[str] = mapped_column(String(16), server_default="pending")
    attempts: Mapped[int] = mapped_column(Integer, server_default="0")
    created_at: Mapped[datetime] = mapped_column(server_default=func.now())
    next_attempt_at: Mapped[datetime] = mapped_column(server_default=func.now())
    last_attempt_at: Mapped[datetime | None]
    last_status_code: Mapped[int | None] = mapped_column(Integer)
    last_error: Mapped[str | None] = mapped_column(Text)
    delivered_at: Mapped[datetime | None]
    failed_at: Mapped[datetime | None]
