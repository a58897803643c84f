"""The SQL side of `?metadata[key]=value` filters: containment on `metadata::jsonb`, the
expression the GIN indexes `ix_jobs_metadata` and `ix_batches_metadata` are built on."""

from __future__ import annotations

from typing import Any

from sqlalchemy import ColumnElement, cast
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import InstrumentedAttribute


def has_metadata(column: InstrumentedAttribute[Any], pairs: dict[str, str]) -> list[ColumnElement[bool]]:
    """WHERE clauses for rows whose metadata holds every pair of `pairs`. `IS NOT NULL` is
    spelled out so the planner can use the partial indexes."""
    return [column.is_not(None), cast(column, JSONB).contains(pairs)]
