"""Loading a tenant's own row, or 404: another tenant's row is as absent as a missing one."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from sqlalchemy import select
from sqlalchemy.orm import Session
from sqlalchemy.orm.interfaces import ORMOption

from app.errors import NotFound
from app.models import Batch, File, Job, WebhookEndpoint

Owned = TypeVar("Owned", Job, Batch, File, WebhookEndpoint)

# OpenAI's wording for each kind, and the parameter that named it.
_MISSING: dict[type, tuple[str, str]] = {
    Job: ("No job found with id '{}'", "job_id"),
    Batch: ("No such Batch object: {}", "batch_id"),
    File: ("No such File object: {}", "file_id"),
    WebhookEndpoint: ("No such webhook endpoint: {}", "webhook_endpoint_id"),
}


def load_owned(
    s: Session,
    model: type[Owned],
    row_id: str,
    tenant_id: str,
    *,
    param: str | None = None,
    options: Sequence[ORMOption] = (),
) -> Owned:
    """Raises NotFound (naming `param`, by default the kind's id) when `tenant_id` has no
    such row. `options`: loader options (columns the caller does not need, deferred)."""
    row = s.scalar(select(model).options(*options).where(model.id == row_id, model.tenant_id == tenant_id))
    if row is None:
        raise not_owned(model, row_id, param=param)
    return row


def not_owned(model: type[Owned], row_id: str, *, param: str | None = None) -> NotFound:
    """The 404 for a row of `model` that `row_id` names and the tenant does not have (it
    does not exist, or another tenant's), in OpenAI's wording for the kind."""
    message, default_param = _MISSING[model]
    return NotFound(message.format(row_id), param=param or default_param)
