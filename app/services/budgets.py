"""Batch token budgets: per tenant and model, the tokens enqueued in unfinished batches may
not pass the tenant's budget (OpenAI's enqueued-token limit). A line's figure is its prompt
tokens plus the completion tokens it may generate (app/domain/budget.py's `line_tokens`),
counted once at upload into `file_lines.tokens` and copied to `jobs.budget_tokens` when the
batch's lines become jobs, so a line that ends releases exactly what it held: the sum only
counts lines `queued` or `running`.

The check runs in the transaction that creates the batch, under the tenant's advisory xact
lock (app/services/quotas.py), so two creates cannot both take the last free tokens. A batch
still `validating` has no job rows yet: its input file's lines count instead."""

from __future__ import annotations

from sqlalchemy import select, text
from sqlalchemy.orm import Session

from app.errors import RateLimited
from app.models import Tenant
from app.services.quotas import lock_tenant

# A line uploaded before budgets existed has no figure: its bytes over 4 stand in for it.
LINE_TOKENS = "coalesce(fl.tokens, ceil(octet_length(fl.raw) / 4.0)::int)"

# What the file's lines need, per model.
_NEEDED = text(
    f"""
    SELECT (fl.raw::json)->'body'->>'model' AS model, sum({LINE_TOKENS})::bigint AS tokens
    FROM file_lines fl WHERE fl.file_id = :file GROUP BY 1 ORDER BY 1
    """  # noqa: S608 - LINE_TOKENS is a constant expression
)

# What the tenant holds for a model: unfinished batch lines (ix_jobs_tenant_active_lines),
# and the lines of its batches still `validating`.
_ENQUEUED = text(
    f"""
    SELECT (SELECT coalesce(sum(budget_tokens), 0) FROM jobs
            WHERE tenant_id = :tenant AND model = :model AND batch_id IS NOT NULL
              AND status IN ('queued', 'running'))
         + (SELECT coalesce(sum({LINE_TOKENS}), 0) FROM batches b
            JOIN file_lines fl ON fl.file_id = b.input_file_id
            WHERE b.status = 'validating' AND b.tenant_id = :tenant
              AND (fl.raw::json)->'body'->>'model' = :model)
    """  # noqa: S608 - LINE_TOKENS is a constant expression
)


def tenant_budget(s: Session, tenant_id: str, default: int) -> int:
    """The tenant's batch token budget per model: its own, else `default` (0: no limit)."""
    own = s.scalar(select(Tenant.batch_token_budget).where(Tenant.id == tenant_id))
    return default if own is None else int(own)


def enqueued_tokens(s: Session, tenant_id: str, model: str) -> int:
    """Tokens the tenant's unfinished batch lines for `model` hold."""
    return int(s.scalar(_ENQUEUED, {"tenant": tenant_id, "model": model}) or 0)


def check_batch_tokens(s: Session, tenant_id: str, file_id: str, default_budget: int) -> None:
    """Raises RateLimited (`token_limit_exceeded`) when the file's lines would take the
    tenant's enqueued tokens for one of their models past its budget; the message says how
    many are free. Call inside the transaction that creates the batch."""
    budget = tenant_budget(s, tenant_id, default_budget)
    if not budget:
        return
    lock_tenant(s, tenant_id)
    for row in s.execute(_NEEDED, {"file": file_id}):
        held = enqueued_tokens(s, tenant_id, row.model)
        if held + int(row.tokens) > budget:
            free = max(0, budget - held)
            raise RateLimited(
                f"this batch needs {row.tokens} tokens for model {row.model!r} but {free} of the "
                f"tenant's {budget} enqueued batch tokens for that model are free ({held} are held "
                "by unfinished batches); retry when earlier batches finish",
                retry_after=60,
                code="token_limit_exceeded",
            )
