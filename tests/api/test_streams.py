"""Streams that end, streams a key may no longer hold, and responses that cannot take the
database pool away (X10, X12, S1, S2): through the Flask app against real Postgres and
Redis, with no worker (jobs stay queued unless a test writes their events itself)."""

from __future__ import annotations

import contextlib
import json
import secrets
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
import redis
from flask import Flask
from flask.testing import FlaskClient
from sqlalchemy import text

import app.services.files as files_module
from app.api import create_app
from app.container import Services, build_services
from app.events import WATCH_CHANNEL, end_channel, job_channel, job_stream, notification
from app.services.feeds import JobFeed
from app.services.sse import HEARTBEAT, frame, frames_of
from app.services.streaming import PIECE_CHARS, StreamService
from tests.helpers import Stores, auth, jsonl, line, make_settings, next_message, subscribers, upload

DONE = "data: [DONE]\n\n"


def job_body(**fields: Any) -> dict[str, Any]:
    return {"model": "api-only", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **fields}


class Reader:
    """Reads a streamed response in a thread, so a stream that never ends fails its test
    (the wait times out) instead of hanging it."""

    def __init__(self, client: FlaskClient, path: str, headers: dict[str, str]) -> None:
        self.status: int | None = None
        self.parts: list[str] = []
        self.opened = threading.Event()
        self.done = threading.Event()
        self._client, self._path, self._headers = client, path, headers
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        response = self._client.get(self._path, headers=self._headers, buffered=False)
        self.status = response.status_code
        self.opened.set()
        try:
            for part in response.response:
                self.parts.append(part.decode() if isinstance(part, bytes) else part)
        finally:
            response.close()
            self.done.set()

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def data(self) -> list[str]:
        return [p for p in self.text.split("\n\n") if p.strip() and not p.startswith(":")]


def wait_until(condition: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return bool(condition())


def chunk(eid: str, content: str) -> dict[str, Any]:
    data = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 0, "model": "api-only"}
    data["choices"] = [{"index": 0, "delta": {"content": content}, "finish_reason": None}]
    return {"id": eid, "type": "chunk", "data": data}


def end(eid: str) -> dict[str, Any]:
    return {"id": eid, "type": "end", "status": "succeeded", "usage": None, "error": None}


def append(r: redis.Redis, job_id: str, event: dict[str, Any], *, carried: bool = True) -> None:
    """What the worker does for each event: append to the log, then notify, carrying the
    event (`carried=False`: the id alone, as an end written from outside the worker)."""
    payload = json.dumps(event)
    r.xadd(job_stream(job_id), {"e": payload}, id=event["id"])
    final = event["type"] == "end"
    header = notification(event["id"], final=final)
    r.publish(job_channel(job_id), f"{payload}\n{header}" if carried else header)
    if final:
        r.publish(end_channel(job_id), header)


@pytest.fixture(scope="module")
def quick(stores: Stores) -> Iterator[Services]:
    """Short heartbeats and key checks, a cap of 3 streams per key, a two-connection pool."""
    svc = build_services(
        make_settings(
            stores,
            sse_heartbeat_seconds=0.5,
            stream_key_check_seconds=0.5,
            max_streams_per_key=3,
            rate_limit_per_minute=0,
            db_pool_size=1,
            db_max_overflow=1,
            db_pool_timeout_seconds=0.5,
        )
    )
    yield svc
    svc.close()


@pytest.fixture(scope="module")
def quick_app(quick: Services) -> Flask:
    return create_app(services=quick)


def new_key(services: Services) -> str:
    return services.keys.create_key(f"tenant-streams-{secrets.token_hex(3)}")


def queued_job(client: FlaskClient, key: str) -> str:
    r = client.post("/v2/jobs", json=job_body(), headers=auth(key))
    assert r.status_code == 202
    return str(r.get_json()["id"])


# --- S2 / X12: a resume at or past the end ends the stream -------------------------------


def succeed(services: Services, job_id: str, response: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Write the job's row as a worker ends it, its recorded stream chunk 1-1, chunk 1-2,
    end 1-3 (returned) and `response`."""
    events = [chunk("1-1", "Hel"), chunk("1-2", "lo"), end("1-3")]
    with services.db.session() as s:
        s.execute(
            text(
                "UPDATE jobs SET status = 'succeeded', epoch = 1, events = CAST(:ev AS json), "
                "response = CAST(:r AS json), succeeded_at = :now WHERE id = :id"
            ),
            {
                "ev": json.dumps(events),
                "r": None if response is None else json.dumps(response),
                "now": datetime.now(UTC),
                "id": job_id,
            },
        )
    return events


@pytest.fixture(params=["redis", "postgres"])
def finished_job(request: pytest.FixtureRequest, client: FlaskClient, services: Services) -> tuple[str, str]:
    """A succeeded job whose log is chunk 1-1, chunk 1-2, end 1-3: in Redis (a recent job)
    or only in Postgres (its Redis Stream expired)."""
    key = new_key(services)
    job_id = queued_job(client, key)
    events = succeed(services, job_id)
    services.redis.delete(job_stream(job_id))
    if request.param == "redis":
        for event in events:
            services.redis.xadd(job_stream(job_id), {"e": json.dumps(event)}, id=event["id"])
    return key, job_id


@pytest.mark.parametrize("resume", ["1-3", "9-0", "1-99", "2-0"])
def test_resume_at_or_past_the_end_ends_at_once(
    client: FlaskClient, finished_job: tuple[str, str], resume: str
) -> None:
    key, job_id = finished_job
    reader = Reader(client, f"/v2/jobs/{job_id}/stream", auth(key) | {"Last-Event-ID": resume})
    assert reader.done.wait(5), f"still open after 5 s: {reader.text!r}"
    assert reader.status == 200
    assert reader.text.endswith(DONE)
    assert "Hel" not in reader.text and "lo" not in reader.text


@pytest.mark.parametrize("resume", [None, "1-1"])
def test_resume_before_the_end_replays_the_rest(
    client: FlaskClient, finished_job: tuple[str, str], resume: str | None
) -> None:
    key, job_id = finished_job
    headers = auth(key) | ({"Last-Event-ID": resume} if resume else {})
    reader = Reader(client, f"/v2/jobs/{job_id}/stream", headers)
    assert reader.done.wait(5)
    contents = [
        json.loads(p.split("data: ", 1)[1])["choices"][0]["delta"]["content"]
        for p in reader.data()
        if p.startswith("id: 1-1") or p.startswith("id: 1-2")
    ]
    assert contents == (["Hel", "lo"] if resume is None else ["lo"])
    assert reader.text.endswith(DONE)


def test_the_events_read_at_once_are_written_as_one_piece(
    client: FlaskClient, finished_job: tuple[str, str]
) -> None:
    """A stream behind the log (here: opened after the job ended) catches up in one write,
    not one per event: the backlog, the end and `[DONE]` are one piece of the body."""
    key, job_id = finished_job
    reader = Reader(client, f"/v2/jobs/{job_id}/stream", auth(key))
    assert reader.done.wait(5)
    assert len(reader.parts) == 1
    assert [p.split("\n", 1)[0] for p in reader.data()] == ["id: 1-1", "id: 1-2", DONE.strip()]


def test_a_long_backlog_is_written_in_pieces_of_bounded_size(client: FlaskClient, services: Services) -> None:
    """However long the log a stream catches up on, one write carries about PIECE_CHARS
    (plus one frame), so a stream holds little beyond the process's copy of the log."""
    key = new_key(services)
    job_id = queued_job(client, key)
    text_of = "x" * 1000
    for seq in range(1, 401):
        event = chunk(f"1-{seq}", text_of)
        services.redis.xadd(job_stream(job_id), {"e": json.dumps(event)}, id=event["id"])
    ended = end("1-401")
    services.redis.xadd(job_stream(job_id), {"e": json.dumps(ended)}, id=ended["id"])
    reader = Reader(client, f"/v2/jobs/{job_id}/stream", auth(key))
    assert reader.done.wait(10)
    one_frame = len(frame(chunk("1-400", text_of)["data"], "1-400"))
    assert len(reader.parts) > 400 * one_frame // PIECE_CHARS
    assert max(len(p) for p in reader.parts) < PIECE_CHARS + 2 * one_frame
    contents = [p for p in reader.data() if p.startswith("id: ")]
    assert [p.split("\n", 1)[0] for p in contents] == [f"id: 1-{i}" for i in range(1, 401)]
    assert reader.text.endswith(DONE)


@pytest.fixture
def view_reads(quick: Services, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Each time a stream reads its job from Postgres; only a heartbeat wakes a quiet
    stream (no key checks)."""
    reads: list[str] = []
    original = StreamService._view

    def counted(self: StreamService, principal: Any, job: str) -> Any:
        reads.append(job)
        return original(self, principal, job)

    monkeypatch.setattr(StreamService, "_view", counted)
    monkeypatch.setattr(quick.streams, "_key_check", 60.0)
    return reads


def test_a_stream_opened_on_a_queued_job_reads_postgres_once_until_its_heartbeat(
    quick_app: Flask, quick: Services, view_reads: list[str]
) -> None:
    """Opening reads the job; with no Redis stream yet (queued), the first look for events
    uses that read instead of a second one (a burst of 600 streams read it twice each)."""
    client = quick_app.test_client()
    key = new_key(quick)
    job_id = queued_job(client, key)
    principal = quick.keys.authenticate(key)
    # The process's notifier connects with its first watcher and wakes every watcher once.
    warm = quick.streams.open_stream(principal, queued_job(client, key), None)
    assert next(warm) == HEARTBEAT
    warm.close()
    reads = view_reads
    reads.clear()
    body = quick.streams.open_stream(principal, job_id, None)
    assert reads == [job_id]
    assert next(body) == HEARTBEAT  # it looked for events, found none, waited a heartbeat
    assert reads == [job_id]
    # Quiet for a whole heartbeat: Postgres is asked again whether the job ended.
    quick.redis.xadd(job_stream(job_id), {"e": json.dumps(chunk("1-1", "a"))}, id="1-1")
    quick.redis.publish(job_channel(job_id), notification("1-1", final=False))
    assert "id: 1-1" in next(body)
    assert reads == [job_id, job_id]
    body.close()


def test_a_streamed_request_relays_its_new_job_without_reading_it_back(
    quick_app: Flask, quick: Services, view_reads: list[str]
) -> None:
    """`stream: true` submits the job and streams it: the job as submitted is the stream's
    view, so nothing is read from Postgres before the stream's first heartbeat (opening read
    it back), and the events, the usage chunk and [DONE] still come as for any stream."""
    client = quick_app.test_client()
    key = new_key(quick)
    principal = quick.keys.authenticate(key)
    warm = quick.streams.open_stream(principal, queued_job(client, key), None)
    assert next(warm) == HEARTBEAT  # the notifier's first wake-up, as above
    warm.close()
    view_reads.clear()
    options = {"stream": True, "stream_options": {"include_usage": True}}
    result = quick.chat.complete(principal, job_body(**options))
    assert result.stream is not None and result.job_id is not None
    assert view_reads == []
    assert next(result.stream) == HEARTBEAT  # it looked for events, found none, waited
    assert view_reads == []
    append(quick.redis, result.job_id, chunk("1-1", "a"))
    assert "id: 1-1" in next(result.stream)
    usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
    append(quick.redis, result.job_id, {**end("1-2"), "usage": usage})
    rest = frames_of("".join(result.stream))  # the end's frames come as one piece
    assert json.loads(rest[0].split("data: ", 1)[1])["usage"] == usage
    assert rest[-1] == DONE
    assert view_reads == [result.job_id]  # only the look after a quiet heartbeat


def test_quiet_streams_of_one_job_share_their_heartbeat_look_at_postgres(
    quick_app: Flask, quick: Services, view_reads: list[str]
) -> None:
    """Each quiet stream asks Postgres at its heartbeat whether the job ended without its
    end event reaching Redis: the job's streams in one process ask once between them."""
    client = quick_app.test_client()
    key = new_key(quick)
    job_id = queued_job(client, key)
    principal = quick.keys.authenticate(key)
    bodies = [quick.streams.open_stream(principal, job_id, None) for _ in range(5)]
    reads = view_reads
    reads.clear()
    threads = [threading.Thread(target=lambda b=b: [next(b), next(b)]) for b in bodies]
    for thread in threads:
        thread.start()
    time.sleep(0.7)  # each has sent its heartbeat (0.5 s) and looked
    quick.redis.xadd(job_stream(job_id), {"e": json.dumps(chunk("1-1", "a"))}, id="1-1")
    quick.redis.publish(job_channel(job_id), notification("1-1", final=False))
    for thread in threads:
        thread.join(5)
    assert reads == [job_id]
    for body in bodies:
        body.close()


# --- X12: a revoked key's stream ends ----------------------------------------------------


def test_revoked_key_ends_its_open_stream(quick_app: Flask, quick: Services) -> None:
    client = quick_app.test_client()
    key = new_key(quick)
    job_id = queued_job(client, key)
    reader = Reader(client, f"/v2/jobs/{job_id}/stream", auth(key))
    assert wait_until(lambda: ": keep-alive" in reader.text, 5), "the stream should be open and idle"
    quick.keys.revoke(quick.keys.authenticate(key).key_id)
    assert reader.done.wait(20), "the stream kept flowing after its key was revoked"
    error = json.loads(reader.data()[-2].split("data: ", 1)[1])["error"]
    assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
    assert reader.text.endswith(DONE)


def test_revoked_key_ends_a_flowing_stream(quick_app: Flask, quick: Services) -> None:
    client = quick_app.test_client()
    key = new_key(quick)
    job_id = queued_job(client, key)
    reader = Reader(client, f"/v2/jobs/{job_id}/stream", auth(key))
    append(quick.redis, job_id, chunk("1-1", "a"))
    assert wait_until(lambda: "id: 1-1" in reader.text, 5)
    quick.keys.revoke(quick.keys.authenticate(key).key_id)
    seq = 2
    deadline = time.monotonic() + 20
    while not reader.done.is_set() and time.monotonic() < deadline:
        append(quick.redis, job_id, chunk(f"1-{seq}", "a"))  # events keep coming
        seq += 1
        time.sleep(0.05)
    assert reader.done.is_set(), "the stream kept flowing after its key was revoked"
    assert "invalid_api_key" in reader.text and reader.text.endswith(DONE)


class SyncCall:
    """`POST /v1/chat/completions` (no `stream`) under a new key, in a thread: once started,
    `job_id` is its job's id and `answer` fills in when it returns."""

    def __init__(self, quick_app: Flask, quick: Services) -> None:
        client = quick_app.test_client()
        key = new_key(quick)
        self.key_id = quick.keys.authenticate(key).key_id
        self.answer: dict[str, Any] = {}

        def call() -> None:
            r = client.post("/v1/chat/completions", json=job_body(), headers=auth(key))
            self.answer["status"], self.answer["body"] = r.status_code, r.get_json()

        self.thread = threading.Thread(target=call, daemon=True)
        self.thread.start()
        found: list[str] = []

        def submitted() -> bool:
            with quick.db.session() as s:
                query = "SELECT j.id FROM jobs j JOIN api_keys k ON k.tenant_id = j.tenant_id WHERE k.id = :k"
                found.extend(s.scalars(text(query), {"k": self.key_id}))
            return bool(found)

        assert wait_until(submitted, 5)
        self.job_id = found[0]


def chat_response() -> dict[str, Any]:
    return {
        "id": "chatcmpl-x",
        "object": "chat.completion",
        "created": 0,
        "model": "api-only",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "Hello"}, "finish_reason": "stop"}
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3},
    }


def test_revoked_key_ends_a_sync_wait(quick_app: Flask, quick: Services) -> None:
    started = time.monotonic()
    sync = SyncCall(quick_app, quick)
    quick.keys.revoke(sync.key_id)
    sync.thread.join(20)
    assert not sync.thread.is_alive() and time.monotonic() - started < 20
    assert sync.answer["status"] == 401 and sync.answer["body"]["error"]["type"] == "authentication_error"


def test_a_sync_wait_answers_with_the_stored_response_once_the_job_ends(
    quick_app: Flask, quick: Services
) -> None:
    """`POST /v1/chat/completions` without `stream` waits while its job is queued (it reads
    the job's status, not the row) and answers with the stored response as soon as the end
    is notified."""
    sync = SyncCall(quick_app, quick)
    sync.thread.join(0.5)
    assert sync.thread.is_alive(), sync.answer  # queued: still waiting
    response = chat_response()
    for event in succeed(quick, sync.job_id, response):
        append(quick.redis, sync.job_id, event)
    sync.thread.join(10)
    assert not sync.thread.is_alive()
    assert sync.answer == {"status": 200, "body": response}


def test_a_sync_wait_listens_for_the_end_alone(
    quick_app: Flask, quick: Services, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A synchronous answer's wait subscribes to the job's end channel, not to its event
    channel: the worker counts no hearer (so it coalesces the job's chunks) and the wait is
    not woken by each chunk. Its heartbeat look at Postgres is a minute away here: only the
    end channel's notification can answer it in time."""
    monkeypatch.setattr(quick.streams, "_heartbeat", 60.0)
    sync = SyncCall(quick_app, quick)
    r = quick.redis
    assert wait_until(lambda: subscribers(r, end_channel(sync.job_id)) == 1, 5)
    assert r.publish(job_channel(sync.job_id), notification("1-1", final=False)) == 0
    for event in succeed(quick, sync.job_id, chat_response()):
        append(r, sync.job_id, event)
    sync.thread.join(5)
    assert not sync.thread.is_alive() and sync.answer == {"status": 200, "body": chat_response()}


def test_a_stream_opened_on_an_unfinished_job_is_announced_to_the_workers(
    quick_app: Flask, quick: Services
) -> None:
    """Opening a stream publishes the job's id on `llmq:watch` once its subscription is
    confirmed (a worker coalescing the job's chunks goes live at once); a finished job's
    stream announces nothing."""
    r = quick.redis
    watch = r.pubsub(ignore_subscribe_messages=True)
    watch.subscribe(WATCH_CHANNEL)
    try:
        assert next_message(watch, 0.2) is None  # the subscription, confirmed
        key = new_key(quick)
        job_id = queued_job(quick_app.test_client(), key)
        principal = quick.keys.authenticate(key)
        body = quick.streams.open_stream(principal, job_id, None)
        assert next(body) == HEARTBEAT
        assert subscribers(r, job_channel(job_id)) == 1
        body.close()
        message = next_message(watch, 2)
        assert message is not None and message["data"] == job_id.encode()
        for event in succeed(quick, job_id):
            append(r, job_id, event)
        ended = quick.streams.open_stream(principal, job_id, None)
        assert "".join(ended).endswith(DONE)
        assert next_message(watch, 0.5) is None
    finally:
        watch.close()


# --- X10: a cap on open streams and downloads per key ------------------------------------


def test_streams_and_downloads_per_key_are_capped(quick_app: Flask, quick: Services) -> None:
    client = quick_app.test_client()
    key, other = new_key(quick), new_key(quick)
    job_id = queued_job(client, key)
    file_id = upload(client, key, jsonl([line(i) for i in range(3)])).get_json()["id"]
    open_ = [client.get(f"/v2/jobs/{job_id}/stream", headers=auth(key), buffered=False) for _ in range(2)]
    download = client.get(f"/v1/files/{file_id}/content", headers=auth(key), buffered=False)
    assert [r.status_code for r in [*open_, download]] == [200, 200, 200]

    over = client.get(f"/v2/jobs/{job_id}/stream", headers=auth(key))
    assert over.status_code == 429
    assert int(over.headers["Retry-After"]) >= 1
    assert over.get_json()["error"]["type"] == "rate_limit_error"
    assert over.get_json()["error"]["code"] == "too_many_streams"
    streaming_chat = client.post("/v1/chat/completions", json=job_body(stream=True), headers=auth(key))
    assert streaming_chat.status_code == 429
    assert client.get(f"/v1/files/{file_id}/content", headers=auth(key)).status_code == 429
    assert client.get("/v2/jobs", headers=auth(key)).status_code == 200  # other calls are not capped

    other_job = queued_job(client, other)
    theirs = client.get(f"/v2/jobs/{other_job}/stream", headers=auth(other), buffered=False)
    assert theirs.status_code == 200  # the cap is per key
    theirs.close()

    download.close()  # closing gives the slot back, even unread
    again = client.get(f"/v1/files/{file_id}/content", headers=auth(key))
    assert again.status_code == 200 and again.data.count(b"\n") == 3
    for r in reversed(open_):  # the test client stacks request contexts: last opened, first closed
        r.close()
    assert quick.slots.held() == 0


def test_a_404_or_bad_cursor_does_not_keep_a_slot(quick_app: Flask, quick: Services) -> None:
    client = quick_app.test_client()
    key = new_key(quick)
    job_id = queued_job(client, key)
    for _ in range(5):
        assert client.get("/v2/jobs/job_missing/stream", headers=auth(key)).status_code == 404
        r = client.get(f"/v2/jobs/{job_id}/stream", headers=auth(key) | {"Last-Event-ID": "x"})
        assert r.status_code == 400
    assert quick.slots.held() == 0


# --- X10: pool-safe downloads and streams ------------------------------------------------


def test_an_unread_download_holds_no_database_connection(quick_app: Flask, quick: Services) -> None:
    client = quick_app.test_client()
    key = new_key(quick)
    file_id = upload(client, key, jsonl([line(i) for i in range(2100)])).get_json()["id"]
    pool = quick.db.engine.pool
    response = client.get(f"/v1/files/{file_id}/content", headers=auth(key), buffered=False)
    body = iter(response.response)
    first = next(body)  # the client read one line of 2100 and stopped
    assert json.loads(first)["custom_id"] == "req-0"
    assert pool.checkedout() == 0  # type: ignore[attr-defined]
    # Another call of the same process still gets the (one-connection) pool.
    assert client.get("/v2/jobs", headers=auth(key)).status_code == 200
    rest = b"".join(body)
    response.close()
    lines = [json.loads(x) for x in (first + rest).splitlines()]
    assert [x["custom_id"] for x in lines] == [f"req-{i}" for i in range(2100)]


def test_a_download_request_waits_for_the_pool_once(quick_app: Flask, quick: Services) -> None:
    """The file's row and its first page are read on one connection: in a burst of
    downloads each request queues for the pool once, not twice."""
    from sqlalchemy import event

    client = quick_app.test_client()
    key = new_key(quick)
    body = jsonl([line(i) for i in range(3)])
    file_id = upload(client, key, body).get_json()["id"]
    assert client.get("/v2/jobs", headers=auth(key)).status_code == 200  # the key is cached now
    checkouts: list[object] = []

    def checked_out(*args: object) -> None:
        checkouts.append(args)

    event.listen(quick.db.engine.pool, "checkout", checked_out)
    try:
        r = client.get(f"/v1/files/{file_id}/content", headers=auth(key))
    finally:
        event.remove(quick.db.engine.pool, "checkout", checked_out)
    assert r.status_code == 200 and r.data == body
    assert len(checkouts) == 1


def test_later_download_pages_never_take_the_last_free_connection(stores: Stores) -> None:
    """In an API process a download's later pages wait while fewer than two connections are
    free, so a request waiting for the pool is never behind them; a first page or a request
    does not. They wait for the pool timeout at most, then ask the pool like anyone else."""
    from app.connections import PoolSize
    from app.db import Database

    def later_page(db: Database, entered: threading.Event) -> None:
        with db.page(first=False) as conn:
            conn.execute(text("SELECT 1"))
            entered.set()

    db = Database.from_url(
        stores.database_url, PoolSize(pool=2, overflow=1), pool_timeout=5, serves_requests=True
    )
    entered = threading.Event()
    try:
        held = [db.engine.connect(), db.engine.connect()]  # one of three left
        reader = threading.Thread(target=later_page, args=(db, entered))
        reader.start()
        assert not entered.wait(0.4)
        with db.page(first=True) as conn:  # takes the last one at once
            assert conn.execute(text("SELECT 1")).scalar() == 1
        assert not entered.is_set()
        held.pop().close()  # two free now
        assert entered.wait(2)
        reader.join(2)
        held.pop().close()
    finally:
        db.dispose()

    # Never free enough: the page waits the pool timeout, then takes the last connection.
    db = Database.from_url(
        stores.database_url, PoolSize(pool=2, overflow=0), pool_timeout=0.5, serves_requests=True
    )
    entered = threading.Event()
    try:
        with db.engine.connect():
            started = time.monotonic()
            later_page(db, entered)
            assert 0.4 < time.monotonic() - started < 3
    finally:
        db.dispose()

    # A worker's database (no requests to make way for) and a pool of one do not wait.
    for pool, serves in ((PoolSize(pool=2, overflow=0), False), (PoolSize(pool=1, overflow=0), True)):
        db = Database.from_url(stores.database_url, pool, pool_timeout=5, serves_requests=serves)
        try:
            with db.engine.connect() if pool.total > 1 else contextlib.nullcontext():
                started = time.monotonic()
                later_page(db, threading.Event())
                assert time.monotonic() - started < 0.3
        finally:
            db.dispose()


def test_a_download_page_is_bounded_in_bytes_not_only_lines(
    quick_app: Flask, quick: Services, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pages stop at the byte budget (at least one line each, even a line over it), so an API
    process holds one page of a file with huge lines, and the file still comes back whole.
    The first page, read before the status line, has a budget of its own."""
    client = quick_app.test_client()
    key = new_key(quick)
    sizes = [300, 300, 300, 5000, 300, 300, 300, 300, 300, 300, 300]  # one line over the budget
    body = jsonl([line(i, messages=[{"role": "user", "content": "x" * n}]) for i, n in enumerate(sizes)])
    file_id = upload(client, key, body).get_json()["id"]
    pages: list[list[int]] = []  # the byte sizes of each page's lines
    real_page_end = files_module.page_end

    def recorded(rows: Any, budget: int) -> int | None:
        end = real_page_end(rows, budget)
        pages.append([size for no, size in rows if end is not None and no <= end])
        return end

    monkeypatch.setattr(files_module, "page_end", recorded)
    assert b"".join(quick.files.input_lines(file_id, page_bytes=1000, first_page_bytes=1)) == body
    assert len(pages[0]) == 1
    assert [len(p) for p in pages if p] != [len(sizes)]  # it did page
    assert all(sum(p) <= 1000 or len(p) == 1 for p in pages)
    assert max(len(p) for p in pages) > 1
    assert [p for p in pages if sum(p) > 1000] == [[len(body.splitlines()[3])]]  # the big line alone
    assert sum(len(p) for p in pages) == len(sizes)


def test_an_unread_batch_output_holds_no_database_connection(quick_app: Flask, quick: Services) -> None:
    from app.services.batch_output import output_lines

    client = quick_app.test_client()
    key = new_key(quick)
    file_id = upload(client, key, jsonl([line(i) for i in range(7)])).get_json()["id"]
    batch = client.post(
        "/v1/batches",
        json={"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"},
        headers=auth(key),
    ).get_json()
    with quick.db.session() as s:
        s.execute(
            text(
                "UPDATE jobs SET status = CASE WHEN custom_id = 'req-3' THEN 'failed' ELSE 'succeeded' END, "
                "response = CAST('{\"ok\": true}' AS json) WHERE batch_id = :b"
            ),
            {"b": batch["id"]},
        )
    lines = output_lines(quick.db, batch["id"], "output", page=2)
    first = next(lines)
    assert quick.db.engine.pool.checkedout() == 0  # type: ignore[attr-defined]
    ids = [json.loads(x)["custom_id"] for x in [first, *lines]]
    assert ids == [f"req-{i}" for i in range(7) if i != 3]
    errors = [json.loads(x)["custom_id"] for x in output_lines(quick.db, batch["id"], "errors", page=2)]
    assert errors == ["req-3"]


def test_an_exhausted_pool_is_a_503_with_retry_after(quick_app: Flask, quick: Services) -> None:
    client = quick_app.test_client()
    key = new_key(quick)
    quick.keys.authenticate(key)
    held = [quick.db.engine.connect(), quick.db.engine.connect()]  # the pool and its overflow
    try:
        r = client.get("/v2/jobs", headers=auth(key))
    finally:
        for conn in held:
            conn.close()
    assert r.status_code == 503
    assert int(r.headers["Retry-After"]) >= 1
    assert r.get_json()["error"]["type"] == "service_unavailable_error"


def test_a_download_whose_first_page_meets_a_full_pool_is_a_503(
    quick_app: Flask, quick: Services, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first page is read before the 200 goes out, so a full pool there is the same 503,
    never a 200 whose body breaks off."""
    from sqlalchemy.exc import TimeoutError as PoolTimeout

    client = quick_app.test_client()
    key = new_key(quick)
    file_id = upload(client, key, jsonl([line(i) for i in range(3)])).get_json()["id"]

    def full_pool(file_id: str, **_: object) -> Iterator[bytes]:
        raise PoolTimeout("QueuePool limit reached")
        yield b""  # a generator, as the real one

    monkeypatch.setattr(quick.files, "input_lines", full_pool)
    for _ in range(4):  # more than the key's cap of 3 open downloads: each 503 gave its slot back
        r = client.get(f"/v1/files/{file_id}/content", headers=auth(key), buffered=False)
        assert r.status_code == 503 and r.get_json()["error"]["type"] == "service_unavailable_error"
    monkeypatch.undo()
    r = client.get(f"/v1/files/{file_id}/content", headers=auth(key))
    assert r.status_code == 200 and r.data == jsonl([line(i) for i in range(3)])


# --- SSE reads shared per job ------------------------------------------------------------


def xrange_calls(r: redis.Redis) -> int:
    stats = r.info("commandstats").get("cmdstat_xrange", {})
    return int(stats.get("calls", 0))


def test_subscribers_of_one_job_share_one_read_per_event(app: Flask, services: Services) -> None:
    key = new_key(services)
    job_id = queued_job(app.test_client(), key)
    readers = [Reader(app.test_client(), f"/v2/jobs/{job_id}/stream", auth(key)) for _ in range(30)]
    append(services.redis, job_id, chunk("1-1", "x"))
    assert wait_until(lambda: all("id: 1-1" in r.text for r in readers), 10)
    before = xrange_calls(services.redis)
    for seq in range(2, 12):
        append(services.redis, job_id, chunk(f"1-{seq}", "x"))
        assert wait_until(lambda seq=seq: all(f"id: 1-{seq}\n" in r.text for r in readers), 10)
    append(services.redis, job_id, end("1-12"))
    assert all(r.done.wait(10) for r in readers)
    reads = xrange_calls(services.redis) - before
    # One read per event per process (11 here), not one per subscriber (330); the slack
    # is for other tests sharing this Redis server.
    assert reads < 60, reads
    for r in readers:
        assert [p.split("\n")[0] for p in r.data()][:11] == [f"id: 1-{i}" for i in range(1, 12)]
        assert r.text.endswith(DONE)


@pytest.fixture
def feed_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Each XRANGE a job's shared feed makes (the job's stream key)."""
    reads: list[str] = []
    original = JobFeed._read

    def counted(self: JobFeed) -> None:
        reads.append(self._key)
        original(self)

    monkeypatch.setattr(JobFeed, "_read", counted)
    return reads


def test_events_carried_by_their_notifications_are_not_read_back(
    quick_app: Flask, quick: Services, feed_reads: list[str]
) -> None:
    """The worker's announcement carries the event: a subscriber whose log is read up to
    the one before relays it without an XRANGE."""
    key = new_key(quick)
    job_id = queued_job(quick_app.test_client(), key)
    reader = Reader(quick_app.test_client(), f"/v2/jobs/{job_id}/stream", auth(key))
    assert wait_until(lambda: ": keep-alive" in reader.text, 5)
    opened = len(feed_reads)
    for seq in range(1, 11):
        append(quick.redis, job_id, chunk(f"1-{seq}", f"t{seq}"))
    append(quick.redis, job_id, end("1-11"))
    assert reader.done.wait(5)
    ids = [p.split("\n")[0] for p in reader.data()]
    assert ids == [f"id: 1-{seq}" for seq in range(1, 11)] + ["data: [DONE]"]
    assert "".join(
        json.loads(p.split("data: ", 1)[1])["choices"][0]["delta"]["content"] for p in reader.data()[:-1]
    ) == "".join(f"t{seq}" for seq in range(1, 11))
    assert feed_reads[opened:] == []


def test_a_carried_event_after_a_gap_waits_for_the_log(
    quick_app: Flask, quick: Services, feed_reads: list[str]
) -> None:
    """An event is kept from its notification only when it follows what was read: after an
    append nobody announced (or an announcement that was missed), the log is read, and the
    subscriber still gets every event once, in order."""
    key = new_key(quick)
    job_id = queued_job(quick_app.test_client(), key)
    reader = Reader(quick_app.test_client(), f"/v2/jobs/{job_id}/stream", auth(key))
    assert wait_until(lambda: ": keep-alive" in reader.text, 5)
    append(quick.redis, job_id, chunk("1-1", "a"))
    assert wait_until(lambda: "id: 1-1" in reader.text, 5)
    opened = len(feed_reads)
    quick.redis.xadd(job_stream(job_id), {"e": json.dumps(chunk("1-2", "b"))}, id="1-2")  # unannounced
    append(quick.redis, job_id, chunk("1-3", "c"))
    append(quick.redis, job_id, end("1-4"), carried=False)
    assert reader.done.wait(5)
    assert [p.split("\n")[0] for p in reader.data()] == ["id: 1-1", "id: 1-2", "id: 1-3", "data: [DONE]"]
    assert len(feed_reads) > opened  # 1-2 and the end came from the log


@pytest.mark.parametrize("carried", [True, False], ids=["carried", "announced"])
def test_a_new_attempt_resets_the_shared_log(quick_app: Flask, quick: Services, carried: bool) -> None:
    """The worker of a new attempt deletes the job's log before its first event; the
    process's shared copy must drop the old attempt too, or a subscriber joining now would
    be replayed the dead attempt and told the stream restarted."""
    key = new_key(quick)
    job_id = queued_job(quick_app.test_client(), key)
    first = Reader(quick_app.test_client(), f"/v2/jobs/{job_id}/stream", auth(key))
    append(quick.redis, job_id, chunk("1-1", "old"), carried=carried)
    append(quick.redis, job_id, chunk("1-2", "old"), carried=carried)
    assert wait_until(lambda: "id: 1-2" in first.text, 5)
    # Keeps the job's shared log alive across the reset: it waits for epoch 2.
    waits_for_2 = auth(key) | {"Last-Event-ID": "2-0"}
    keeper = Reader(quick_app.test_client(), f"/v2/jobs/{job_id}/stream", waits_for_2)
    assert wait_until(lambda: ": keep-alive" in keeper.text, 5)

    quick.redis.delete(job_stream(job_id))
    append(quick.redis, job_id, chunk("2-1", "new"), carried=carried)
    assert first.done.wait(5) and "stream_restarted" in first.text
    assert wait_until(lambda: "id: 2-1" in keeper.text, 5)

    late = Reader(quick_app.test_client(), f"/v2/jobs/{job_id}/stream", auth(key))
    assert wait_until(lambda: "id: 2-1" in late.text, 5)
    append(quick.redis, job_id, end("2-2"), carried=carried)
    assert late.done.wait(5) and keeper.done.wait(5)
    assert [p.split("\n")[0] for p in late.data()] == ["id: 2-1", "data: [DONE]"]
    assert "old" not in late.text and "stream_restarted" not in late.text
