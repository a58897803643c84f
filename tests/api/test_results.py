"""`GET /v1/batches/<id>/results`: a batch's ended lines while it runs, as JSONL or followed
as SSE, through the Flask app against real Postgres and Redis. No worker: the tests end
lines by writing their terminal states, each call one transaction, as a worker does."""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
from flask import Flask
from flask.testing import FlaskClient
from sqlalchemy import Connection, text
from sqlalchemy.orm import Session

from app.api import create_app
from app.container import Services, build_services
from app.services.batch_lifecycle import BatchLifecycle
from app.services.results import ResultsService
from app.services.streaming import KeyWatch
from tests.helpers import Stores, auth, create, jsonl, line, make_settings, upload


@pytest.fixture(scope="module")
def quick(stores: Stores) -> Iterator[Services]:
    """Followers poll every 50 ms; short heartbeats and key checks; 3 streams per key."""
    svc = build_services(
        make_settings(
            stores,
            results_poll_seconds=0.05,
            sse_heartbeat_seconds=0.5,
            stream_key_check_seconds=0.5,
            max_streams_per_key=3,
            rate_limit_per_minute=0,
        )
    )
    yield svc
    svc.close()


@pytest.fixture(scope="module")
def quick_app(quick: Services) -> Flask:
    return create_app(services=quick)


@pytest.fixture
def client(quick_app: Flask) -> FlaskClient:
    return quick_app.test_client()


def new_key(services: Services) -> str:
    return services.keys.create_key(f"tenant-results-{secrets.token_hex(3)}")


def new_batch(client: FlaskClient, key: str, n: int) -> str:
    file_id = upload(client, key, jsonl([line(i) for i in range(n)])).get_json()["id"]
    r = create(client, key, file_id)
    assert r.status_code == 200, r.get_json()
    return str(r.get_json()["id"])


_END = text(
    "UPDATE jobs SET status = :status, response = CAST(:response AS json), error = CAST(:error AS json) "
    "WHERE batch_id = :batch AND custom_id = :custom_id"
)


def end_in(conn: Connection | Session, batch_id: str, lines: dict[int, str]) -> None:
    """End `lines` ({line: status}) in `conn`'s transaction."""
    for i, status in lines.items():
        response = {"id": f"chatcmpl-{i}", "object": "chat.completion", "note": f"héllo ✓ {i}"}
        error = {
            "error": {"message": f"bad {i}", "type": "invalid_request_error", "param": None, "code": "x"}
        }
        conn.execute(
            _END,
            {
                "status": status,
                "response": json.dumps(response) if status == "succeeded" else None,
                "error": json.dumps(error) if status == "failed" else None,
                "batch": batch_id,
                "custom_id": f"req-{i}",
            },
        )


def end(services: Services, batch_id: str, lines: dict[int, str]) -> None:
    """End `lines` in one committed transaction, as a worker's result write does."""
    with services.db.session() as s:
        end_in(s, batch_id, lines)


def finalize(services: Services) -> None:
    BatchLifecycle(services.db, services.queue, services.events, window=64, chunk=8).finalize_done()


def results(client: FlaskClient, key: str, batch_id: str, **params: str) -> tuple[list[bytes], Any]:
    r = client.get(f"/v1/batches/{batch_id}/results", query_string=params, headers=auth(key))
    assert r.status_code == 200, r.get_json()
    assert r.mimetype == "application/jsonl"
    return r.data.splitlines(keepends=True), r.headers


def ids(lines: list[bytes]) -> list[str]:
    return [json.loads(x)["custom_id"] for x in lines]


def file_lines(client: FlaskClient, key: str, batch_id: str) -> list[bytes]:
    batch = client.get(f"/v1/batches/{batch_id}", headers=auth(key)).get_json()
    out: list[bytes] = []
    for field in ("output_file_id", "error_file_id"):
        if batch[field]:
            out += client.get(f"/v1/files/{batch[field]}/content", headers=auth(key)).data.splitlines(True)
    return out


# --- JSONL ---------------------------------------------------------------------------------


def test_lines_come_in_the_order_they_ended_and_end_equal_to_the_files(
    client: FlaskClient, quick: Services
) -> None:
    key = new_key(quick)
    batch_id = new_batch(client, key, 6)
    lines, headers = results(client, key, batch_id)
    assert lines == [] and headers["X-Llmq-Batch-Status"] == "in_progress"
    assert "X-Llmq-Cursor" not in headers

    end(quick, batch_id, {4: "succeeded"})
    end(quick, batch_id, {2: "succeeded", 0: "succeeded", 1: "failed"})
    lines, headers = results(client, key, batch_id)
    # By transaction, then by line within one.
    assert ids(lines) == ["req-4", "req-0", "req-1", "req-2"]
    assert headers["X-Llmq-Batch-Status"] == "in_progress" and headers["X-Llmq-Cursor"]
    failed = json.loads(lines[2])
    assert (
        failed["response"]["status_code"] == 400 and failed["response"]["body"]["error"]["message"] == "bad 1"
    )

    assert client.post(f"/v1/batches/{batch_id}/cancel", headers=auth(key)).status_code == 200
    finalize(quick)
    final, headers = results(client, key, batch_id)
    assert headers["X-Llmq-Batch-Status"] == "cancelled"
    assert final[:4] == lines, "a growing prefix: what was sent before comes first, unchanged"
    assert ids(final[4:]) == ["req-3", "req-5"]
    assert json.loads(final[4])["error"]["code"] == "batch_cancelled"
    # Byte for byte the lines of the output and error files, each once.
    assert sorted(final) == sorted(file_lines(client, key, batch_id))
    assert "héllo ✓ 4" in final[0].decode()


def test_after_skips_what_the_client_has(client: FlaskClient, quick: Services) -> None:
    key = new_key(quick)
    batch_id = new_batch(client, key, 5)
    end(quick, batch_id, {3: "succeeded", 1: "succeeded"})
    first, headers = results(client, key, batch_id)
    cursor = headers["X-Llmq-Cursor"]
    end(quick, batch_id, {0: "failed"})
    end(quick, batch_id, {4: "succeeded"})
    more, headers = results(client, key, batch_id, after=cursor)
    assert ids(first) == ["req-1", "req-3"] and ids(more) == ["req-0", "req-4"]
    whole, _ = results(client, key, batch_id)
    assert whole == first + more
    # At the end: nothing more, and the cursor stays where it was.
    last = headers["X-Llmq-Cursor"]
    none, headers = results(client, key, batch_id, after=last)
    assert none == [] and headers["X-Llmq-Cursor"] == last
    # Every cursor in the middle continues from that line.
    middle, _ = results(client, key, batch_id, after=cursor)
    assert middle == more


@pytest.mark.parametrize("bad", ["x", "1-2", "1.", "-1.2", "1.2.3", "9" * 19 + ".1"])
def test_a_bad_cursor_is_a_400_and_keeps_no_slot(client: FlaskClient, quick: Services, bad: str) -> None:
    key = new_key(quick)
    batch_id = new_batch(client, key, 1)
    for query, headers in (
        ({"after": bad}, {}),
        ({"follow": "true"}, {"Last-Event-ID": bad}),
    ):
        r = client.get(
            f"/v1/batches/{batch_id}/results", query_string=query, headers={**auth(key), **headers}
        )
        assert r.status_code == 400 and r.get_json()["error"]["code"] == "invalid_cursor"
    r = client.get(f"/v1/batches/{batch_id}/results", query_string={"follow": "maybe"}, headers=auth(key))
    assert r.status_code == 400 and r.get_json()["error"]["param"] == "follow"
    assert quick.slots.held() == 0


def test_another_tenants_batch_is_404_and_keeps_no_slot(client: FlaskClient, quick: Services) -> None:
    owner, other = new_key(quick), new_key(quick)
    batch_id = new_batch(client, owner, 2)
    end(quick, batch_id, {0: "succeeded"})
    for query in ({}, {"follow": "true"}, {"after": "1.1"}):
        r = client.get(f"/v1/batches/{batch_id}/results", query_string=query, headers=auth(other))
        assert r.status_code == 404 and r.get_json()["error"]["param"] == "batch_id"
        assert b"req-0" not in r.data
    assert quick.slots.held() == 0
    assert ids(results(client, owner, batch_id)[0]) == ["req-0"]


# --- the horizon: a line still being committed never lets a later one pass it --------------


def test_a_line_ended_in_a_transaction_still_open_holds_back_the_lines_after_it(
    client: FlaskClient, quick: Services
) -> None:
    key = new_key(quick)
    batch_id = new_batch(client, key, 3)
    with quick.db.engine.connect() as slow:
        end_in(slow, batch_id, {0: "succeeded"})  # ended, not yet committed
        end(quick, batch_id, {1: "succeeded"})  # a later transaction, committed first
        held, headers = results(client, key, batch_id)
        assert held == [] and "X-Llmq-Cursor" not in headers
        slow.commit()
    lines, _ = results(client, key, batch_id)
    assert ids(lines) == ["req-0", "req-1"]


def test_a_transaction_that_began_earlier_and_ends_a_line_later_is_waited_for(
    client: FlaskClient, quick: Services
) -> None:
    key = new_key(quick)
    batch_id = new_batch(client, key, 3)
    end(quick, batch_id, {2: "succeeded"})
    seen, headers = results(client, key, batch_id)
    assert ids(seen) == ["req-2"]
    with quick.db.engine.connect() as slow:
        slow.execute(text("SELECT pg_current_xact_id()"))  # has its id, ends nothing yet
        end(quick, batch_id, {1: "succeeded"})
        assert results(client, key, batch_id, after=headers["X-Llmq-Cursor"])[0] == []
        end_in(slow, batch_id, {0: "failed"})
        slow.commit()
    more, _ = results(client, key, batch_id, after=headers["X-Llmq-Cursor"])
    assert ids(more) == ["req-0", "req-1"]  # the older transaction's line first
    assert results(client, key, batch_id)[0] == seen + more


def test_an_open_transaction_of_another_database_holds_nothing_back(
    client: FlaskClient, quick: Services, stores: Stores
) -> None:
    key = new_key(quick)
    batch_id = new_batch(client, key, 2)
    elsewhere = psycopg.connect(stores.database_url.rsplit("/", 1)[0] + "/postgres")
    try:
        elsewhere.execute("SELECT pg_current_xact_id()")
        end(quick, batch_id, {0: "succeeded"})
        assert ids(results(client, key, batch_id)[0]) == ["req-0"]
    finally:
        elsewhere.close()


def test_an_ended_batch_releases_every_line_whatever_is_open(client: FlaskClient, quick: Services) -> None:
    key = new_key(quick)
    batch_id = new_batch(client, key, 2)
    with quick.db.engine.connect() as slow:
        slow.execute(text("SELECT pg_current_xact_id()"))
        end(quick, batch_id, {0: "succeeded", 1: "failed"})
        assert results(client, key, batch_id)[0] == []
        finalize(quick)
        lines, headers = results(client, key, batch_id)
        assert headers["X-Llmq-Batch-Status"] == "completed" and ids(lines) == ["req-0", "req-1"]


def test_an_unread_results_body_holds_no_database_connection(client: FlaskClient, quick: Services) -> None:
    key = new_key(quick)
    batch_id = new_batch(client, key, 7)
    end(quick, batch_id, {i: "succeeded" for i in range(7)})
    small_pages = ResultsService(quick.db, quick.batches, KeyWatch(quick.keys, 1.0), page=2)
    prefix = small_pages.prefix(quick.keys.authenticate(key), batch_id, None)
    first = next(prefix.lines)
    assert quick.db.engine.pool.checkedout() == 0  # type: ignore[attr-defined]
    assert ids([first, *prefix.lines]) == [f"req-{i}" for i in range(7)]


# --- SSE -----------------------------------------------------------------------------------


@dataclass
class Event:
    id: str | None
    name: str | None
    data: str


class Follower:
    """Reads a followed response in a thread, so a stream that never ends fails its test
    (the wait times out) instead of hanging it."""

    def __init__(self, client: FlaskClient, path: str, headers: dict[str, str]) -> None:
        self.status: int | None = None
        self.mimetype: str | None = None
        self.parts: list[str] = []
        self.done = threading.Event()
        self._stop = threading.Event()
        self._client, self._path, self._headers = client, path, headers
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        response = self._client.get(self._path, headers=self._headers, buffered=False)
        self.status, self.mimetype = response.status_code, response.mimetype
        try:
            for part in response.response:
                self.parts.append(part.decode() if isinstance(part, bytes) else part)
                if self._stop.is_set():
                    break
        finally:
            response.close()
            self.done.set()

    def stop(self) -> None:
        self._stop.set()

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def events(self) -> list[Event]:
        out = []
        for block in self.text.split("\n\n"):
            fields: dict[str, str] = {}
            for row in block.splitlines():
                if row and not row.startswith(":"):
                    name, _, value = row.partition(": ")
                    fields[name] = value
            if "data" in fields:
                out.append(Event(fields.get("id"), fields.get("event"), fields["data"]))
        return out

    def lines(self) -> list[dict[str, Any]]:
        return [json.loads(e.data) for e in self.events() if e.name is None and e.data != "[DONE]"]


def wait_until(condition: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return bool(condition())


def test_follow_sends_lines_as_they_end_resumes_and_ends_with_the_batch(
    client: FlaskClient, quick: Services
) -> None:
    key = new_key(quick)
    batch_id = new_batch(client, key, 5)
    path = f"/v1/batches/{batch_id}/results?follow=true"
    first = Follower(client, path, auth(key))
    assert wait_until(lambda: ": keep-alive" in first.text, 5), "open and idle, with heartbeats"
    assert first.status == 200 and first.mimetype == "text/event-stream"
    end(quick, batch_id, {3: "succeeded"})
    end(quick, batch_id, {0: "failed"})
    assert wait_until(lambda: len(first.lines()) == 2, 5)
    first.stop()
    end(quick, batch_id, {1: "succeeded"})  # wakes the reader, which then closes
    assert first.done.wait(5)
    got = first.events()[:2]
    assert [json.loads(e.data)["custom_id"] for e in got] == ["req-3", "req-0"]
    assert all(e.id for e in got)

    # Resume after the first line: the rest, then live lines, then the batch's end.
    resumed = Follower(
        client,
        f"/v1/batches/{batch_id}/results",
        {**auth(key), "Accept": "text/event-stream", "Last-Event-ID": str(got[0].id)},
    )
    assert wait_until(lambda: len(resumed.lines()) == 2, 5)
    assert [x["custom_id"] for x in resumed.lines()] == ["req-0", "req-1"]
    end(quick, batch_id, {2: "succeeded", 4: "succeeded"})
    assert wait_until(lambda: len(resumed.lines()) == 4, 5)
    assert not resumed.done.is_set(), "the batch has not ended"
    finalize(quick)
    assert resumed.done.wait(5), "the stream ends when the batch ends"
    events = resumed.events()
    assert events[-1].data == "[DONE]"
    assert events[-2].name == "batch"
    batch = json.loads(events[-2].data)
    assert batch["id"] == batch_id and batch["status"] == "completed" and batch["output_file_id"]
    ids_seen = [json.loads(e.data)["custom_id"] for e in got[:1]] + [x["custom_id"] for x in resumed.lines()]
    assert ids_seen == ["req-3", "req-0", "req-1", "req-2", "req-4"]
    # The stream's lines are the JSONL lines, the output and error files' lines.
    whole, _ = results(client, key, batch_id)
    assert [json.loads(e.data) for e in got[:1]] + resumed.lines() == [json.loads(x) for x in whole]
    assert quick.slots.held() == 0


def test_follow_on_an_ended_batch_sends_everything_and_ends(client: FlaskClient, quick: Services) -> None:
    key = new_key(quick)
    batch_id = new_batch(client, key, 3)
    end(quick, batch_id, {0: "succeeded", 1: "succeeded", 2: "failed"})
    finalize(quick)
    whole = Follower(client, f"/v1/batches/{batch_id}/results?follow=1", auth(key))
    assert whole.done.wait(5)
    assert [x["custom_id"] for x in whole.lines()] == ["req-0", "req-1", "req-2"]
    last_id = whole.events()[-3].id
    # Resumed at the end: only the end.
    at_end = Follower(
        client, f"/v1/batches/{batch_id}/results?follow=1", {**auth(key), "Last-Event-ID": last_id or ""}
    )
    assert at_end.done.wait(5)
    assert [e.name for e in at_end.events()] == ["batch", None] and at_end.text.endswith("data: [DONE]\n\n")
    # `follow=false` wins over the Accept header.
    r = client.get(
        f"/v1/batches/{batch_id}/results?follow=false", headers={**auth(key), "Accept": "text/event-stream"}
    )
    assert r.mimetype == "application/jsonl" and len(r.data.splitlines()) == 3


def test_a_revoked_key_ends_its_follow(client: FlaskClient, quick: Services) -> None:
    key = new_key(quick)
    batch_id = new_batch(client, key, 2)
    follower = Follower(client, f"/v1/batches/{batch_id}/results?follow=true", auth(key))
    assert wait_until(lambda: ": keep-alive" in follower.text, 5)
    quick.keys.revoke(quick.keys.authenticate(key).key_id)
    assert follower.done.wait(10), "the stream kept going after its key was revoked"
    assert "invalid_api_key" in follower.text and follower.text.endswith("data: [DONE]\n\n")


def test_followers_count_against_the_stream_cap(client: FlaskClient, quick: Services) -> None:
    key = new_key(quick)
    batch_id = new_batch(client, key, 1)
    open_ = [Follower(client, f"/v1/batches/{batch_id}/results?follow=true", auth(key)) for _ in range(3)]
    assert wait_until(lambda: all(f.status == 200 for f in open_), 5)
    over = client.get(f"/v1/batches/{batch_id}/results", headers=auth(key))
    assert over.status_code == 429 and over.get_json()["error"]["code"] == "too_many_streams"
    end(quick, batch_id, {0: "succeeded"})
    finalize(quick)
    assert all(f.done.wait(5) for f in open_)
    assert wait_until(lambda: quick.slots.held() == 0, 5)
