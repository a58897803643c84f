"""X-Request-ID through the Flask app: kept or made, returned on every response, written in
one access log line per request and in every line logged while handling it, stored on the
jobs the request creates and sent in their messages' headers."""

from __future__ import annotations

import io
import json
import logging
import re
import secrets
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from flask.testing import FlaskClient
from kombu import Consumer, Exchange, Queue
from sqlalchemy import text

from app.container import Services
from app.logs import JsonFormatter
from app.queue import queue_name
from app.request_ids import HEADER, MESSAGE_HEADER, RequestIdFilter
from tests.helpers import auth, jsonl, line, upload

GENERATED = re.compile(r"req_[0-9a-z]{26}")


def body(**fields: Any) -> dict[str, Any]:
    return {"model": "api-only", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **fields}


@pytest.fixture
def key(services: Services) -> str:
    return services.keys.create_key(f"tenant-reqid-{secrets.token_hex(3)}")


@contextmanager
def json_lines() -> Iterator[io.StringIO]:
    """Every record at INFO and above as llmq's JSON formatter writes it, with the request
    id filter llmq's own handler has."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter())
    handler.addFilter(RequestIdFilter())
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.INFO)
    root.addHandler(handler)
    try:
        yield out
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


def records(out: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(x) for x in out.getvalue().splitlines() if x.strip()]


def test_every_response_gets_a_generated_id_when_none_was_sent(client: FlaskClient, key: str) -> None:
    responses = [
        client.get("/v2/jobs", headers=auth(key)),  # 200
        client.get("/v2/jobs"),  # 401
        client.get("/v2/jobs/job_nope", headers=auth(key)),  # 404 of a route
        client.get("/no/such/route"),  # 404 of routing
        client.delete("/v2/jobs", headers=auth(key)),  # 405
        client.post("/v2/jobs", data=b"{not json", headers=auth(key), content_type="application/json"),
        client.get("/healthz"),
    ]
    ids = [r.headers.get(HEADER) for r in responses]
    assert all(i is not None and GENERATED.fullmatch(i) for i in ids), ids
    assert len(set(ids)) == len(ids)


def test_a_sane_client_id_is_kept(client: FlaskClient, key: str) -> None:
    for sent in ["abc", "trace-1.2:3_x", "A" * 128, "550e8400-e29b-41d4-a716-446655440000"]:
        r = client.get("/v2/jobs", headers=auth(key) | {HEADER: sent})
        assert r.headers[HEADER] == sent
    assert client.get("/nowhere", headers={HEADER: "kept-on-404"}).headers[HEADER] == "kept-on-404"


@pytest.mark.parametrize("sent", ["A" * 129, "has space", "a/b", 'quote"d', "semi;colon", "é"])
def test_an_insane_client_id_is_replaced(client: FlaskClient, key: str, sent: str) -> None:
    r = client.get("/v2/jobs", headers=auth(key) | {HEADER: sent})
    assert r.status_code == 200
    assert GENERATED.fullmatch(r.headers[HEADER])


def test_one_access_line_per_request_without_the_key_or_query_values(
    client: FlaskClient, key: str, services: Services
) -> None:
    tenant = services.keys.authenticate(key).tenant_id
    with json_lines() as out:
        r = client.get("/v2/jobs?limit=3&after=secretish", headers=auth(key) | {HEADER: "access-1"})
        assert r.status_code == 200
        r.close()
        bad = client.get("/v2/jobs/job_nope", headers={"Authorization": "Bearer wrongwrongwrong"})
        bad.close()
    # Only this test's requests: a response another test left open is logged when it closes.
    mine = {"access-1", bad.headers[HEADER]}
    access = [x for x in records(out) if x["logger"] == "llmq.access" and x["request_id"] in mine]
    assert len(access) == 2, access
    ok, refused = access
    assert ok["method"] == "GET" and ok["path"] == "/v2/jobs" and ok["status"] == 200
    assert ok["request_id"] == "access-1" and ok["tenant"] == tenant
    assert ok["bytes"] == len(r.data) and ok["duration_ms"] >= 0 and ok["client"] == "127.0.0.1"
    assert refused["status"] == 401 and "tenant" not in refused
    assert refused["request_id"] == bad.headers[HEADER]
    text_out = out.getvalue()
    assert key not in text_out and "wrongwrongwrong" not in text_out and "secretish" not in text_out


def test_the_access_line_names_the_address_through_trusted_proxies(stores, key: str) -> None:  # type: ignore[no-untyped-def]
    from app.api import create_app
    from tests.helpers import make_settings

    app = create_app(make_settings(stores).model_copy(update={"trusted_proxy_hops": 1}))
    with json_lines() as out:
        app.test_client().get("/v1/models", headers={"X-Forwarded-For": "6.6.6.6, 10.1.2.3"}).close()
        app.test_client().get("/healthz").close()  # a probe that succeeds: DEBUG, not here
    (access,) = [x for x in records(out) if x["logger"] == "llmq.access"]
    assert access["client"] == "10.1.2.3" and access["path"] == "/v1/models"


def test_a_job_stores_and_returns_its_request_id_and_every_line_carries_it(
    client: FlaskClient, key: str, services: Services
) -> None:
    with json_lines() as out:
        r = client.post("/v2/jobs", json=body(), headers=auth(key) | {HEADER: "job-trace-7"})
    assert r.status_code == 202 and r.headers[HEADER] == "job-trace-7"
    job_id = r.get_json()["id"]
    assert r.get_json()["request_id"] == "job-trace-7"
    got = client.get(f"/v2/jobs/{job_id}", headers=auth(key) | {HEADER: "later"})
    assert got.get_json()["request_id"] == "job-trace-7" and got.headers[HEADER] == "later"
    with services.db.session() as s:
        stored = s.execute(text("SELECT request_id FROM jobs WHERE id = :id"), {"id": job_id}).scalar()
    assert stored == "job-trace-7"
    lines = [x for x in records(out) if x.get("job_id") == job_id or x["logger"] == "llmq.access"]
    assert {x["msg"] for x in lines} >= {"job accepted"}
    assert all(x.get("request_id") == "job-trace-7" for x in records(out)), records(out)


def test_a_job_made_without_an_id_stores_the_generated_one(client: FlaskClient, key: str) -> None:
    r = client.post("/v2/jobs", json=body(), headers=auth(key))
    assert r.get_json()["request_id"] == r.headers[HEADER]
    assert GENERATED.fullmatch(r.headers[HEADER])


def test_a_stream_response_carries_the_id(client: FlaskClient, key: str) -> None:
    job_id = client.post("/v2/jobs", json=body(), headers=auth(key)).get_json()["id"]
    r = client.get(f"/v2/jobs/{job_id}/stream", headers=auth(key) | {HEADER: "stream-1"})
    assert r.status_code == 200 and r.mimetype == "text/event-stream"
    assert r.headers[HEADER] == "stream-1"
    r.close()


def test_a_batch_and_each_of_its_lines_carry_the_creating_requests_id(client: FlaskClient, key: str) -> None:
    f = upload(client, key, jsonl([line(i) for i in range(3)])).get_json()
    r = client.post(
        "/v1/batches",
        json={"input_file_id": f["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"},
        headers=auth(key) | {HEADER: "batch-trace-1"},
    )
    assert r.status_code == 200, r.get_json()
    batch = r.get_json()
    assert batch["x_request_id"] == "batch-trace-1"
    jobs = client.get(f"/v2/jobs?batch_id={batch['id']}", headers=auth(key)).get_json()["data"]
    assert len(jobs) == 3 and {j["request_id"] for j in jobs} == {"batch-trace-1"}
    client.post(f"/v1/batches/{batch['id']}/cancel", headers=auth(key)).close()


def test_the_jobs_message_carries_the_request_id_in_its_headers(services: Services) -> None:
    """A model of its own, so this test's consumer takes only its own message."""
    model, job_id = f"reqid-{secrets.token_hex(3)}", f"job_reqid_{secrets.token_hex(4)}"
    services.queue.enqueue(job_id, model, 0, request_id="msg-trace-1")
    name = queue_name(model)
    taken: list[Any] = []
    with services.queue._celery.connection_for_read() as conn:
        consumer = Consumer(
            conn.default_channel,
            queues=[Queue(name, Exchange(name), routing_key=name)],
            callbacks=[lambda _body, message: taken.append(message)],
            no_ack=False,
        )
        with consumer:
            deadline = time.monotonic() + 10
            while not taken:
                assert time.monotonic() < deadline
                try:
                    conn.drain_events(timeout=1)
                except TimeoutError:
                    continue
            taken[0].ack()
    services.liveness.spent(job_id)
    assert taken[0].headers[MESSAGE_HEADER] == "msg-trace-1"
