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

from collections.abc import Callable

from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from app.db import Database
from app.domain.status import BatchStatus, JobStatus
from app.errors import RateLimited
from app.models import Batch, Job

_ACTIVE = (JobStatus.QUEUED.value, JobStatus.RUNNING.value)
_LOCK = text("SELECT pg_advisory_xact_lock(hashtextextended(:key, 0))")
_LOCK_SHARED = text("SELECT pg_advisory_xact_lock_shared(hashtextextended(:key, 0))")


def lock_tenant(s: Session, tenant_id: str, *, shared: bool = False) -> None:
    """Serialise this tenant's cap checks until the transaction ends (commit or rollback);
    `shared`: only against exclusive holders (see the module's docstring)."""
    s.execute(_LOCK_SHARED if shared else _LOCK, {"key": f"llmq:tenant-cap:{tenant_id}"})


class _NearCap(Exception):
    """Too close to the cap for the shared lock: start again under the exclusive one."""


def insert_single_job(db: Database, tenant_id: str, cap: int, insert: Callable[[Session], object]) -> None:
    """Run `insert` (one single job) in a transaction that keeps the tenant's single jobs
    queued or running at `cap` at most (0: no cap).

    Raises:
        RateLimited: the tenant has `cap` single jobs queued or running.
    """
    if cap:
        try:
            with db.session() as s:
                lock_tenant(s, tenant_id, shared=True)
                # max_connections as the server has it now (a restart may have raised it).
                active, bound = s.execute(_ACTIVE_SINGLE, {"tenant_id": tenant_id}).one()
                if active + bound < cap:
                    insert(s)
                    return
                raise _NearCap
        except _NearCap:
            pass
    with db.session() as s:
        check_single_jobs(s, tenant_id, cap)
        insert(s)


# Every single-job submit runs this: a constant text statement costs SQLAlchemy no
# statement building or cache-key walk (the `select()` built per call was about a tenth of
# a submit's CPU in the API). The tenant's single jobs queued or running, and Postgres's
# max_connections (the shared path's bound).
_ACTIVE_SINGLE = text(
    "SELECT count(*), current_setting('max_connections')::int FROM jobs WHERE tenant_id = :tenant_id "
    "AND batch_id IS NULL AND status IN ('queued', 'running')"
)
assert _ACTIVE == ("queued", "running")


def _unfinished(s: Session, tenant_id: str, *, batch_lines: bool) -> int:
    if not batch_lines:
        return int(s.execute(_ACTIVE_SINGLE, {"tenant_id": tenant_id}).one()[0])
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
