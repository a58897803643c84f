"""`metadata`: the string pairs a client attaches to a job or a batch, and the filters the
list endpoints take (`?metadata[key]=value`, several AND-ed). One rule for every place that
accepts them, OpenAI's: at most 16 pairs, keys up to 64 characters, values up to 512.

Stored metadata is indexed as `jsonb` (a GIN index on `metadata::jsonb`), and `jsonb` cannot
hold U+0000, so neither may a key or a value."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from app.errors import InvalidRequest

MAX_PAIRS = 16
MAX_KEY_CHARS = 64
MAX_VALUE_CHARS = 512

_FILTER = re.compile(r"^metadata\[(.*)\]$")

_NO_NUL = "^[^\\u0000]*$"
# The same rule for the OpenAPI document (request bodies and the list filters).
JSON_SCHEMA: dict[str, Any] = {
    "maxProperties": MAX_PAIRS,
    "propertyNames": {"minLength": 1, "maxLength": MAX_KEY_CHARS, "pattern": _NO_NUL},
    "additionalProperties": {"type": "string", "maxLength": MAX_VALUE_CHARS, "pattern": _NO_NUL},
}


def check_metadata(metadata: Mapping[str, Any] | None, *, param: str = "metadata") -> None:
    """Raises InvalidRequest naming the pair (`metadata.<key>`) that breaks a limit."""
    if not metadata:
        return
    if len(metadata) > MAX_PAIRS:
        raise InvalidRequest(f"{param} has {len(metadata)} pairs; the limit is {MAX_PAIRS}", param=param)
    for key, value in metadata.items():
        where = f"{param}.{key[:MAX_KEY_CHARS]}"
        if not isinstance(value, str):
            raise InvalidRequest(f"{param} values are strings; {key!r} is not", param=where)
        if not key or len(key) > MAX_KEY_CHARS or len(value) > MAX_VALUE_CHARS:
            raise InvalidRequest(
                f"{param} keys are 1 to {MAX_KEY_CHARS} characters, values at most {MAX_VALUE_CHARS}",
                param=where,
            )
        if "\x00" in key or "\x00" in value:
            raise InvalidRequest(f"{param} holds a NUL character (U+0000)", param=where)


def metadata_filter(args: Iterable[tuple[str, str]]) -> dict[str, str]:
    """The `metadata[key]=value` query parameters among `args` (every other name is left to
    the caller), as the pairs a listed object's metadata must contain.

    Raises:
        InvalidRequest: naming the parameter: `metadata` without a key, an empty key, a key
            given twice, a key or value over its limit, or more than 16 filters.
    """
    found: dict[str, str] = {}
    for name, value in args:
        if name == "metadata":
            raise InvalidRequest("filter metadata as metadata[key]=value", param=name)
        match = _FILTER.match(name)
        if match is None:
            continue
        key = match.group(1)
        if not key:
            raise InvalidRequest("metadata[] needs a key: metadata[key]=value", param=name)
        if key in found:
            raise InvalidRequest(f"{name} is given more than once", param=name)
        found[key] = value
    if len(found) > MAX_PAIRS:
        raise InvalidRequest(f"at most {MAX_PAIRS} metadata filters; got {len(found)}", param="metadata")
    for key, value in found.items():
        name = f"metadata[{key}]"
        if len(key) > MAX_KEY_CHARS or len(value) > MAX_VALUE_CHARS:
            raise InvalidRequest(
                f"metadata keys are at most {MAX_KEY_CHARS} characters, values {MAX_VALUE_CHARS}", param=name
            )
        if "\x00" in key or "\x00" in value:
            raise InvalidRequest("a metadata filter holds a NUL character (U+0000)", param=name)
    return found
