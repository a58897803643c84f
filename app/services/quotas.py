"""Per-tenant caps on unfinished work: single jobs queued or running, and batch lines not
yet finished. Each check runs inside the transaction that inserts the work, after taking a
transaction-scoped advisory lock on the tenant, so concurrent submits cannot both see room
that only one of them may use: count and insert are one atomic step per tenant."""

from __future__ import annotations

from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from app.domain.status import BatchStatus, JobStatus
from app.errors import RateLimited
from app.models import Batch, Job

_ACTIVE = (JobStatus.QUEUED.value, JobStatus.RUNNING.value)
_LOCK = text("SELECT pg_advisory_xact_lock(hashtextextended(:key, 0))")


def lock_tenant(s: Session, tenant_id: str) -> None:
    """Serialise this tenant's cap checks until the transaction ends (commit or rollback)."""
    s.execute(_LOCK, {"key": f"llmq:tenant-cap:{tenant_id}"})


# Every single-job submit runs this: a constant text statement costs SQLAlchemy no
# statement building or cache-key walk (the `select()` built per call was about a tenth of
# a submit's CPU in the API).
_ACTIVE_SINGLE = text(
    "SELECT count(*) FROM jobs WHERE tenant_id = :tenant_id AND batch_id IS NULL "
    "AND status IN ('queued', 'running')"
)
assert _ACTIVE == ("queued", "running")


def _unfinished(s: Session, tenant_id: str, *, batch_lines: bool) -> int:
    if not batch_lines:
        return int(s.scalar(_ACTIVE_SINGLE, {"tenant_id": tenant_id}) or 0)
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
