"""Per-tenant caps on unfinished work: single jobs queued or running, and batch lines not
yet finished. Each check runs inside the transaction that inserts the work, after taking a
transaction-scoped advisory lock on the tenant, so concurrent submits cannot both see room
that only one of them may use: count and insert are one atomic step per tenant.

Single jobs far from the cap take that lock shared, so a tenant's concurrent submits do not
wait for each other's commits (held exclusively, 64 concurrent submits of one tenant were
serialised: 0.4 s of lock wait each). That stays exact: of every transaction that commits a
job after some submit counted, all but those that counted later were open when it counted,
and at most `max_connections` transactions are open at once; so the one that counted last
saw a total at most `max_connections` short of the final one. A submit that finds fewer than
`max_connections` places left starts again under the exclusive lock, which waits for every
shared holder to commit, and counts exactly (so the last `max_connections` places cost two
transactions each; with `max_connections` at or above the cap, every submit does).
`max_connections` is read with each count, so a Postgres restarted with more is seen."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from psycopg.types.json import Json
from sqlalchemy import JSON, bindparam, func, insert, select, text
from sqlalchemy.dialects.postgresql import psycopg as postgresql_psycopg
from sqlalchemy.orm import Session

from app.db import Database
from app.domain.status import BatchStatus, JobStatus
from app.errors import RateLimited
from app.models import Batch, Job

_ACTIVE = (JobStatus.QUEUED.value, JobStatus.RUNNING.value)
_LOCK = text("SELECT pg_advisory_xact_lock(hashtextextended(:key, 0))")


def lock_tenant(s: Session, tenant_id: str) -> None:
    """Serialise this tenant's cap checks until the transaction ends (commit or rollback).
    Submits far from the cap take it shared (`insert_single_job`)."""
    s.execute(_LOCK, {"key": _lock_key(tenant_id)})


def insert_single_job(db: Database, tenant_id: str, cap: int, row: Mapping[str, Any]) -> None:
    """Insert one single job (`row`: the jobs table's column names and values) in a
    transaction that keeps the tenant's single jobs queued or running at `cap` at most
    (0: no cap).

    Far from the cap this is one round trip to Postgres (`Database.at_once`): the shared
    lock, then an INSERT that counts and inserts in one statement, its snapshot taken once
    the lock is held, so it sees what the shared path's bound assumes (the module's
    docstring). It inserts nothing when the tenant is near the cap, and the exclusive path
    below counts exactly.

    Raises:
        RateLimited: the tenant has `cap` single jobs queued or running.
    """
    params = {name: Json(value) if name in _JSON_COLUMNS else value for name, value in row.items()}
    columns = tuple(row)
    if not cap:
        db.at_once([(_insert_sql(columns, guarded=False), params)])
        return
    lock = (_LOCK_SHARED_SQL, {"key": _lock_key(tenant_id)})
    if db.at_once([lock, (_insert_sql(columns, guarded=True), {**params, _CAP: cap})]) == 1:
        return
    with db.session() as s:
        check_single_jobs(s, tenant_id, cap)
        s.execute(_INSERT_JOB, dict(row))


def _lock_key(tenant_id: str) -> str:
    return f"llmq:tenant-cap:{tenant_id}"


_JOBS = Job.metadata.tables[Job.__tablename__]
_INSERT_JOB = insert(_JOBS)
_JSON_COLUMNS = frozenset(column.name for column in _JOBS.columns if isinstance(column.type, JSON))
_CAP = "llmq_cap"
_LOCK_SHARED_SQL = "SELECT pg_advisory_xact_lock_shared(hashtextextended(%(key)s, 0))"


@functools.cache
def _insert_sql(columns: tuple[str, ...], *, guarded: bool) -> str:
    """One job row's INSERT in driver SQL, each value `%(column)s` with the cast SQLAlchemy's
    own INSERT gives it (`::VARCHAR`, never a length that would cut a value short; `::JSON`),
    so a row reads back the same whichever path wrote it. `guarded`: made only while the
    tenant's single jobs queued or running plus max_connections (as the server has it now)
    are fewer than `%(llmq_cap)s`."""
    dialect = postgresql_psycopg.dialect()  # type: ignore[no-untyped-call]
    quote = dialect.identifier_preparer.quote

    def value(name: str) -> str:
        return str(bindparam(name, type_=_JOBS.c[name].type).compile(dialect=dialect))

    sql = f"INSERT INTO {_JOBS.name} ({', '.join(quote(c) for c in columns)})"
    if not guarded:
        return f"{sql} VALUES ({', '.join(value(c) for c in columns)})"
    # Names come from the table's metadata (`_JOBS.c[name]` refuses any other), values are
    # parameters.
    active = (
        f"SELECT count(*) FROM {_JOBS.name} WHERE tenant_id = {value('tenant_id')} "  # noqa: S608
        "AND batch_id IS NULL AND status IN ('queued', 'running')"
    )
    return (
        f"{sql} SELECT {', '.join(value(c) for c in columns)} "
        f"WHERE ({active}) + current_setting('max_connections')::int < %({_CAP})s"
    )


# The tenant's single jobs queued or running (the exclusive path's exact count).
_ACTIVE_SINGLE = text(
    "SELECT count(*) FROM jobs WHERE tenant_id = :tenant_id "
    "AND batch_id IS NULL AND status IN ('queued', 'running')"
)
assert _ACTIVE == ("queued", "running")


def _unfinished(s: Session, tenant_id: str, *, batch_lines: bool) -> int:
    if not batch_lines:
        return int(s.execute(_ACTIVE_SINGLE, {"tenant_id": tenant_id}).scalar_one())
    q = (
        select(func.count())
        .select_from(Job)
        .where(Job.tenant_id == tenant_id, Job.batch_id.is_not(None), Job.status.in_(_ACTIVE))
    )
    # A batch still `validating` has committed its row but not yet its job rows: its lines
    # count already, or two creates could both see room only one may use.
    validating = select(func.coalesce(func.sum(Batch.total), 0)).where(
        Batch.tenant_id == tenant_id, Batch.status == BatchStatus.VALIDATING.value
    )
    return int(s.scalar(q) or 0) + int(s.scalar(validating) or 0)


def check_single_jobs(s: Session, tenant_id: str, cap: int) -> None:
    """Raises RateLimited when the tenant has `cap` single jobs queued or running (0: no cap).
    Call inside the inserting transaction."""
    if not cap:
        return
    lock_tenant(s, tenant_id)
    active = _unfinished(s, tenant_id, batch_lines=False)
    if active >= cap:
        raise RateLimited(
            f"{active} jobs are queued or running for this tenant; the cap is {cap}", retry_after=5
        )


def check_batch_lines(s: Session, tenant_id: str, adding: int, cap: int) -> None:
    """Raises RateLimited when `adding` more batch lines would take the tenant's unfinished
    lines past `cap` (0: no cap). Call inside the inserting transaction."""
    if not cap:
        return
    lock_tenant(s, tenant_id)
    active = _unfinished(s, tenant_id, batch_lines=True)
    if active + adding > cap:
        free = max(0, cap - active)
        raise RateLimited(
            f"this batch has {adding} lines but only {free} of the tenant's {cap} unfinished "
            f"batch lines are free ({active} are queued or running); retry when earlier batches finish",
            retry_after=30,
        )
