"""Around every HTTP request: its request id and its access log line.

A WSGI middleware, so that nothing escapes it: 404s and 405s, 413s, errors and streamed
bodies (an SSE stream is logged when it ends, with its full duration and size). The
request runs in a context of its own (`contextvars.copy_context`), each step of its body
included, so its id is current in every log line it causes and in no other request's.
"""

from __future__ import annotations

import contextvars
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from types import TracebackType
from typing import TYPE_CHECKING, Any

from app.metrics import ROUTE_KEY
from app.request_ids import HEADER, RequestInfo, bind, chosen

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIApplication, WSGIEnvironment

log = logging.getLogger("llmq.access")

# Health probes and metric scrapes: logged at DEBUG when they succeed.
QUIET_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})

_ExcInfo = tuple[type[BaseException], BaseException, TracebackType] | tuple[None, None, None]


def peer_address(environ: WSGIEnvironment, trusted_proxy_hops: int) -> str:
    """The caller's address: the peer, or with `trusted_proxy_hops` = N the address the
    outermost of N trusted proxies saw (N entries from the right of X-Forwarded-For, which
    each proxy appends to; anything further left is the client's to forge)."""
    if trusted_proxy_hops > 0:
        forwarded = [a.strip() for a in str(environ.get("HTTP_X_FORWARDED_FOR", "")).split(",")]
        forwarded = [a for a in forwarded if a]
        if len(forwarded) >= trusted_proxy_hops:
            return forwarded[-trusted_proxy_hops][:64]
    return str(environ.get("REMOTE_ADDR") or "unknown")


# (route, method, status, seconds): told of each request once its response has ended.
Observer = Callable[[str | None, str, int, float], None]


class AccessLog:
    """Wraps the Flask app's `wsgi_app`; `observe` gets each request's figures (app/metrics.py)."""

    def __init__(
        self, app: WSGIApplication, *, trusted_proxy_hops: int, observe: Observer | None = None
    ) -> None:
        self._app = app
        self._hops = trusted_proxy_hops
        self._observe = observe

    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        info = RequestInfo(chosen(environ.get("HTTP_X_REQUEST_ID")))
        context = contextvars.copy_context()
        context.run(bind, info)
        line = _Line(info, environ, peer_address(environ, self._hops), self._observe)

        def start(status: str, headers: list[tuple[str, str]], exc_info: _ExcInfo | None = None) -> Any:
            line.status = int(status.split(" ", 1)[0])
            headers = [(k, v) for k, v in headers if k.lower() != HEADER.lower()]
            headers.append((HEADER, info.request_id))
            return start_response(status, headers, exc_info)

        try:
            body = context.run(self._app, environ, start)
        except BaseException:
            line.status = 500
            context.run(line.write)
            raise
        return _Body(body, context, line)


class _Line:
    def __init__(
        self, info: RequestInfo, environ: WSGIEnvironment, client: str, observe: Observer | None
    ) -> None:
        self.info = info
        self.environ = environ
        self.observe = observe
        self.method = str(environ.get("REQUEST_METHOD", ""))
        # The path alone: a query string's values are the client's and may hold anything.
        self.path = str(environ.get("SCRIPT_NAME", "")) + str(environ.get("PATH_INFO", ""))
        self.client = client
        self.started = time.monotonic()
        self.status = 0
        self.bytes = 0
        self.written = False

    def write(self) -> None:
        if self.written:
            return
        self.written = True
        seconds = time.monotonic() - self.started
        if self.observe is not None:
            self.observe(self.environ.get(ROUTE_KEY), self.method, self.status, seconds)
        extra: dict[str, Any] = {
            "method": self.method,
            "path": self.path,
            "status": self.status,
            "duration_ms": round(seconds * 1000, 1),
            "bytes": self.bytes,
            "client": self.client,
            "request_id": self.info.request_id,
        }
        if self.info.tenant is not None:
            extra["tenant"] = self.info.tenant
        # Probes and scrapes that succeed come every few seconds: DEBUG, not INFO.
        level = logging.DEBUG if self.path in QUIET_PATHS and self.status < 400 else logging.INFO
        log.log(level, "%s %s %s", self.method, self.path, self.status, extra=extra)


class _Body:
    """The response body, each step run in the request's context; its close writes the line."""

    def __init__(self, body: Iterable[bytes], context: contextvars.Context, line: _Line) -> None:
        self._body = body
        self._context = context
        self._line = line
        self._iter: Iterator[bytes] = context.run(iter, body)

    def __iter__(self) -> _Body:
        return self

    def __next__(self) -> bytes:
        chunk = self._context.run(next, self._iter)
        self._line.bytes += len(chunk)
        return chunk

    def close(self) -> None:
        close: Callable[[], None] | None = getattr(self._body, "close", None)
        try:
            if close is not None:
                self._context.run(close)
        finally:
            self._context.run(self._line.write)
