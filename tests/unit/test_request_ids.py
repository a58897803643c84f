"""Request ids without servers: the log filter and formatters, and the WSGI middleware that
gives each request its id and its access line (streamed bodies and failures included)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest

from app.api.access import AccessLog, peer_address
from app.logs import JsonFormatter, KeyValueFormatter
from app.request_ids import HEADER, RequestIdFilter, bound, chosen, current_request_id, sane


def record(**extra: Any) -> logging.LogRecord:
    rec = logging.makeLogRecord({"name": "any.library", "msg": "hello", "levelname": "INFO", **extra})
    assert RequestIdFilter().filter(rec)
    return rec


def test_sane_ids_are_kept_and_others_replaced() -> None:
    for good in ["a", "A" * 128, "x-1.2:3_4", "550e8400-e29b-41d4-a716-446655440000"]:
        assert sane(good) and chosen(good) == good
    for bad in [None, "", "A" * 129, "a b", "a/b", "a\nb", "é", "a;b", "a\x00b"]:
        assert not sane(bad)
        new = chosen(bad)
        assert new.startswith("req_") and sane(new) and new != bad


def test_the_filter_adds_the_current_id_to_every_logger_and_keeps_a_records_own() -> None:
    assert not hasattr(record(), "request_id")
    with bound("req-1"):
        assert record().request_id == "req-1"
        assert record(request_id="own").request_id == "own"
    assert current_request_id() is None and not hasattr(record(), "request_id")


def test_both_formats_write_the_request_id() -> None:
    with bound("req-fmt"):
        rec = record()
    assert json.loads(JsonFormatter().format(rec))["request_id"] == "req-fmt"
    assert KeyValueFormatter("%(name)s: %(message)s").format(rec) == "any.library: hello request_id=req-fmt"


class Captured(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.addFilter(RequestIdFilter())
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def captured() -> Iterator[Captured]:
    handler = Captured()
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.INFO)
    root.addHandler(handler)
    yield handler
    root.removeHandler(handler)
    root.setLevel(level)


def streaming_app(environ: dict[str, Any], start_response: Any) -> Iterator[bytes]:
    start_response("200 OK", [("Content-Type", "text/plain"), (HEADER, "the app's own")])
    for i in range(3):
        logging.getLogger("some.library").info("chunk %d", i)
        yield b"abcd"


def call(app: Any, environ: dict[str, Any]) -> tuple[list[tuple[str, str]], bytes]:
    seen: list[tuple[str, str]] = []

    def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> None:
        seen.extend(headers)

    body = app(environ, start_response)
    try:
        data = b"".join(body)
    finally:
        body.close()
    return seen, data


def environ(**extra: str) -> dict[str, Any]:
    return {
        "REQUEST_METHOD": "GET",
        "PATH_INFO": "/v2/jobs",
        "QUERY_STRING": "q=secret",
        "REMOTE_ADDR": "1.2.3.4",
        **extra,
    }


def test_a_streamed_response_logs_under_its_id_and_ends_with_one_access_line(captured: Captured) -> None:
    app = AccessLog(streaming_app, trusted_proxy_hops=0)
    headers, data = call(app, environ(HTTP_X_REQUEST_ID="stream-9"))
    assert data == b"abcd" * 3
    assert [v for k, v in headers if k == HEADER] == ["stream-9"]  # the app's own is replaced
    chunks = [r for r in captured.records if r.name == "some.library"]
    assert [getattr(r, "request_id", None) for r in chunks] == ["stream-9"] * 3
    (access,) = [r for r in captured.records if r.name == "llmq.access"]
    assert access.status == 200 and access.bytes == 12  # type: ignore[attr-defined]
    assert access.path == "/v2/jobs" and access.method == "GET" and access.client == "1.2.3.4"  # type: ignore[attr-defined]
    assert "secret" not in access.getMessage()
    # The request's id never leaks into its caller's context.
    assert current_request_id() is None


def test_a_request_that_raises_is_logged_as_a_500_under_its_id(captured: Captured) -> None:
    def failing(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        logging.getLogger("app.code").error("about to fail")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        AccessLog(failing, trusted_proxy_hops=0)(environ(), lambda *a: None)
    failed, access = captured.records
    assert failed.request_id == access.request_id  # type: ignore[attr-defined]
    assert access.status == 500  # type: ignore[attr-defined]
    assert current_request_id() is None


def test_the_client_address_honours_trusted_proxy_hops() -> None:
    env = environ(HTTP_X_FORWARDED_FOR="6.6.6.6, 10.0.0.1, 10.0.0.2")
    assert peer_address(env, 0) == "1.2.3.4"
    assert peer_address(env, 1) == "10.0.0.2"
    assert peer_address(env, 2) == "10.0.0.1"
    assert peer_address(environ(HTTP_X_FORWARDED_FOR="10.0.0.2"), 2) == "1.2.3.4"
