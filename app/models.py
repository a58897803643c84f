"""Postgres tables, typed with SQLAlchemy 2.0. Postgres is the source of truth."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from app.domain.status import JobKind, JobStatus

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {dict[str, Any]: JSONB, datetime: DateTime(timezone=True)}


class Tenant(Base):
    __tablename__ = "tenants"
    __table_args__ = (CheckConstraint("priority_min <= priority_max", name="priority_band"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    created_at: Mapped[datetime] = mapped_column(server_default=func.now())
    # The `priority` values this tenant's requests may ask for (app/services/priority.py).
    priority_min: Mapped[int] = mapped_column(Integer, server_default="0")
    priority_max: Mapped[int] = mapped_column(Integer, server_default="100")


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
        UniqueConstraint("tenant_id", "idempotency_key", name="uq_jobs_tenant_idempotency"),
        UniqueConstraint("batch_id", "line_no", name="uq_jobs_batch_line"),
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
            "batch_id",
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
    custom_id: Mapped[str | None] = mapped_column(Text)
    line_no: Mapped[int | None] = mapped_column(Integer)
    # The transaction (xid8) that ended the batch line, set by the trigger of migration
    # 20261201_0012 (0 for lines that ended before it): app/services/results.py.
    finished_xid: Mapped[int | None] = mapped_column(BigInteger)


class File(Base):
    """An uploaded input file (its lines in `file_lines`), or a batch's output or error file,
    whose content is generated from the batch's job rows when read."""

    __tablename__ = "files"
    __table_args__ = (Index("ix_files_tenant_id_id", "tenant_id", "id"),)

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


class FileLine(Base):
    """One line of an input file, as uploaded (after validation)."""

    __tablename__ = "file_lines"

    file_id: Mapped[str] = mapped_column(ForeignKey("files.id", ondelete="CASCADE"), primary_key=True)
    line_no: Mapped[int] = mapped_column(Integer, primary_key=True)
    custom_id: Mapped[str] = mapped_column(Text)
    raw: Mapped[str] = mapped_column(Text)


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
    created_at: Mapped[datetime] = mapped_column(server_default=func.now())
    expires_at: Mapped[datetime]
    in_progress_at: Mapped[datetime | None]
    finalizing_at: Mapped[datetime | None]
    completed_at: Mapped[datetime | None]
    failed_at: Mapped[datetime | None]
    expired_at: Mapped[datetime | None]
    cancelling_at: Mapped[datetime | None]
    cancelled_at: Mapped[datetime | None]
