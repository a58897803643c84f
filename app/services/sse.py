"""SSE framing: how a job's events, errors and keep-alives are written on the stream."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

from app.errors import error_object
from app.events import EventId
from app.jsontext import compact

HEARTBEAT = ": keep-alive\n\n"
DONE = "data: [DONE]\n\n"


def frame(data: Mapping[str, Any], event_id: str) -> str:
    return f"id: {event_id}\ndata: {compact(data)}\n\n"


def frames_of(text: str) -> list[str]:
    """The frames in one piece of a stream (`_sse` in app/services/streaming.py writes the
    events it read at once as one piece). A frame's JSON never holds a raw newline, so a
    blank line ends each."""
    return [part + "\n\n" for part in text.split("\n\n") if part]


def frame_data(text: str) -> str | None:
    """The `data:` payload of one frame written here (`frame`, `DONE`, the error frames),
    or None for a frame without one (a heartbeat)."""
    for line in text.split("\n"):
        if line.startswith("data: "):
            return line[len("data: ") :]
    return None


def named_frame(event: str, data: Mapping[str, Any]) -> str:
    """An event with a name (`event:`), for what is not one of the stream's items."""
    return f"event: {event}\ndata: {compact(data)}\n\n"


def revoked() -> Iterator[str]:
    error = error_object("the API key was revoked", "authentication_error", code="invalid_api_key")
    yield f"data: {json.dumps({'error': error})}\n\n"
    yield DONE


def restarted(eid: EventId) -> Iterator[str]:
    error = error_object(
        "the job was restarted after a worker failure; reconnect without Last-Event-ID "
        "to receive the new attempt from its start",
        "stream_restarted",
        code="stream_restarted",
    )
    yield f"id: {eid}\ndata: {json.dumps({'error': error})}\n\n"
    yield DONE
