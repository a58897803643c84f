"""The project's pydantic base models."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class WireModel(BaseModel):
    """A shape that crosses a boundary. Unknown fields are refused, `model_*` names allowed."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class OpenModel(BaseModel):
    """A shape whose contents we do not own (JSON schemas, metadata): anything goes."""

    model_config = ConfigDict(extra="allow", protected_namespaces=())
