"""JSON on llmq's hot paths, by pydantic-core (Rust) rather than the json module.

Compact text for what llmq writes for every job, event and frame (a result's documents, a
job's stream events in Redis, whoever appends them, an SSE frame): json.dumps with
`separators` builds a new encoder for every call, and took 2-3 times as long (a one-token
completion: 6.6 against 2.3 µs). Non-ASCII text goes as UTF-8, not as escapes; control
characters (U+0000 included) are escaped all the same, as JSON requires.

And the parser of every json and jsonb column read from Postgres (`loads`, psycopg's loader
for llmq's engines) and of every stream event the API relays: faster than json.loads (a
one-token completion's response, 20,000 distinct ones: 6.2 against 2.3 µs; a chunk's event
3.7 against 1.4), which a batch's finalize runs once per line to measure its output, every
download of it again, and a stream once per chunk."""

from __future__ import annotations

import json
from typing import Any

from pydantic_core import PydanticSerializationError, from_json, to_json


def compact_bytes(value: Any) -> bytes:
    """`value` as compact UTF-8 JSON. A string that UTF-8 cannot hold (a lone surrogate,
    which a JSON escape can carry in) is left to json.dumps, which escapes it."""
    try:
        return to_json(value)
    except PydanticSerializationError:
        return json.dumps(value, separators=(",", ":")).encode()


def compact(value: Any) -> str:
    """`compact_bytes` as text."""
    return compact_bytes(value).decode()


def loads(data: str | bytes) -> Any:
    """JSON text as Python values, as json.loads gives them. Past the parser's nesting limit
    (200 levels) json.loads takes the text instead."""
    try:
        return from_json(data)
    except ValueError:
        return json.loads(data)
