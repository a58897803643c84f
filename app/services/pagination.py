"""Cursor pagination of a tenant's list (jobs, files, batches): newest first, keyset on
the id (ids sort by creation time), `after` the last id of the previous page."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, TypeVar

from sqlalchemy import Select
from sqlalchemy.orm import InstrumentedAttribute, Session

from app.errors import InvalidRequest

T = TypeVar("T")


class _HasId(Protocol):
    @property
    def id(self) -> str: ...


def check_limit(limit: int, maximum: int) -> None:
    """Raises InvalidRequest (param `limit`) outside 1..maximum."""
    if not 1 <= limit <= maximum:
        raise InvalidRequest(f"`limit` must be between 1 and {maximum}", param="limit")


def newest_first(
    s: Session, q: Select[T], id_column: InstrumentedAttribute[str], *, after: str | None, limit: int
) -> tuple[list[T], bool]:
    """One page of `q`'s rows after the cursor, and whether more follow."""
    if after:
        q = q.where(id_column < after)
    rows = list(s.scalars(q.order_by(id_column.desc()).limit(limit + 1)))
    return rows[:limit], len(rows) > limit


def page_fields(data: Sequence[_HasId], has_more: bool) -> dict[str, Any]:
    """A list page's cursor fields: `first_id`, `last_id`, `has_more`."""
    return {
        "first_id": data[0].id if data else None,
        "last_id": data[-1].id if data else None,
        "has_more": has_more,
    }
