"""Request ids: one per HTTP request, kept when the client sent a sane one.

The id lives in a context variable for the life of the request (its streamed body
included), so every log line written while handling it carries `request_id` through
`RequestIdFilter`, whichever logger wrote it. It is stored on the jobs the request
creates and travels in their Celery messages' headers, so the worker's lines for a job
carry it too.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

from app.ids import new_id

HEADER = "X-Request-ID"
# The Celery message header that carries a job's request id to the worker.
MESSAGE_HEADER = "llmq_request_id"
_SANE = re.compile(r"[A-Za-z0-9._:-]{1,128}")


@dataclass
class RequestInfo:
    """What the access log learns while a request is handled."""

    request_id: str
    tenant: str | None = None


_current: ContextVar[RequestInfo | None] = ContextVar("llmq_request", default=None)


def sane(value: str | None) -> bool:
    """A client's id is kept when it is 1-128 characters of `[A-Za-z0-9._:-]`."""
    return value is not None and _SANE.fullmatch(value) is not None


def new_request_id() -> str:
    return new_id("req")


def chosen(sent: str | None) -> str:
    """The id a request runs under: the client's when sane, else a new one."""
    return sent if sent is not None and sane(sent) else new_request_id()


def current() -> RequestInfo | None:
    return _current.get()


def current_request_id() -> str | None:
    info = _current.get()
    return info.request_id if info is not None else None


def note_tenant(tenant: str) -> None:
    """The request's caller is known: the access log names its tenant."""
    info = _current.get()
    if info is not None:
        info.tenant = tenant


def bind(info: RequestInfo | None) -> None:
    """Make `info` the current request of this context (None: no request)."""
    _current.set(info)


@contextmanager
def bound(request_id: str | None) -> Iterator[None]:
    """Within the block, `request_id` is this context's (a worker's task for one job)."""
    token = _current.set(RequestInfo(request_id) if request_id else None)
    try:
        yield
    finally:
        _current.reset(token)


class RequestIdFilter(logging.Filter):
    """Adds `request_id` to every record written while a request is handled; a record
    that names its own (a worker's line for a job) keeps it."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            rid = current_request_id()
            if rid is not None:
                record.request_id = rid
        return True
