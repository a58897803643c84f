"""The project's pydantic base models."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict


class WireModel(BaseModel):
    """A shape that crosses a boundary. Unknown fields are refused, `model_*` names allowed."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class OpenModel(BaseModel):
    """A shape whose contents we do not own (JSON schemas, metadata): anything goes."""

    model_config = ConfigDict(extra="allow", protected_namespaces=())


def unix_time(value: datetime | None) -> int | None:
    """A timestamp as the wire carries it: whole seconds since the epoch, or None."""
    return int(value.timestamp()) if value is not None else None
