"""Webhook endpoints over HTTP, the outbox written with the state changes that cause its
events, and the deliverer against a real local receiver (down for a while, then up)."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import standardwebhooks
from flask import Flask
from flask.testing import FlaskClient
from sqlalchemy import text

from app.api import create_app
from app.container import Services, build_services
from app.domain.webhooks import EventType, RetrySchedule
from app.schemas.chat import ChatCompletionV2Request
from app.services.addresses import system_resolver
from app.services.batch_lifecycle import BatchLifecycle
from app.services.webhook_delivery import DeliveryConfig, WebhookDeliverer
from tests.helpers import Stores, auth, create, jsonl, line, make_settings, upload
from tests.webhook_receiver import Receiver
from worker.store import JobStore, Result

ALL = [t.value for t in EventType]
SDK = openai.OpenAI(api_key="unused", base_url="http://127.0.0.1:9/v1")


@pytest.fixture(scope="module")
def hooks(stores: Stores) -> Iterator[Services]:
    """Services whose endpoints may point at this machine (the receiver is local)."""
    services = build_services(
        make_settings(stores, webhook_allow_private=True, webhook_max_endpoints_per_tenant=3)
    )
    yield services
    services.close()


@pytest.fixture(scope="module")
def hooks_app(hooks: Services) -> Flask:
    return create_app(services=hooks)


@pytest.fixture
def hc(hooks_app: Flask) -> FlaskClient:
    return hooks_app.test_client()


@pytest.fixture
def key(hooks: Services) -> str:
    return hooks.keys.create_key(f"tenant-hooks-{secrets.token_hex(3)}")


def deliverer(services: Services, **schedule: float) -> WebhookDeliverer:
    return WebhookDeliverer(
        services.db,
        system_resolver(2.0),
        DeliveryConfig(connect_timeout=1, timeout=2, allow_private=True, schedule=RetrySchedule(**schedule)),
    )


def deliveries(client: FlaskClient, key: str, endpoint_id: str, **query: Any) -> list[dict[str, Any]]:
    r = client.get(f"/v1/webhook_endpoints/{endpoint_id}/deliveries", query_string=query, headers=auth(key))
    assert r.status_code == 200, r.get_json()
    return list(r.get_json()["data"])


def endpoint(client: FlaskClient, key: str, url: str, events: list[str] | None = None) -> dict[str, Any]:
    r = client.post(
        "/v1/webhook_endpoints",
        json={"url": url, "event_types": events or ALL, "name": "t"},
        headers=auth(key),
    )
    assert r.status_code == 200, r.get_json()
    return dict(r.get_json())


# --- endpoints ---------------------------------------------------------------------------


def test_create_shows_the_secret_once_then_only_a_hint(hc: FlaskClient, key: str) -> None:
    created = endpoint(hc, key, "https://hooks.example.com/in", ["batch.completed"])
    assert created["object"] == "webhook_endpoint" and created["signing_secret"].startswith("whsec_")
    assert created["event_types"] == ["batch.completed"]
    got = hc.get(f"/v1/webhook_endpoints/{created['id']}", headers=auth(key)).get_json()
    assert "signing_secret" not in got and got["signing_secret_hint"] == created["signing_secret_hint"]
    listed = hc.get("/v1/webhook_endpoints", headers=auth(key)).get_json()
    assert [e["id"] for e in listed["data"]] == [created["id"]] and listed["has_more"] is False

    rotated = hc.post(f"/v1/webhook_endpoints/{created['id']}/rotate_secret", headers=auth(key)).get_json()
    assert (
        rotated["signing_secret"].startswith("whsec_")
        and rotated["signing_secret"] != created["signing_secret"]
    )

    updated = hc.post(
        f"/v1/webhook_endpoints/{created['id']}", json={"events": ["job.failed"]}, headers=auth(key)
    ).get_json()
    assert updated["event_types"] == ["job.failed"] and updated["url"] == created["url"]

    gone = hc.delete(f"/v1/webhook_endpoints/{created['id']}", headers=auth(key)).get_json()
    assert gone == {"id": created["id"], "object": "webhook_endpoint.deleted", "deleted": True}
    assert hc.get(f"/v1/webhook_endpoints/{created['id']}", headers=auth(key)).status_code == 404


def test_another_tenant_sees_nothing(hc: FlaskClient, key: str, hooks: Services) -> None:
    other = hooks.keys.create_key(f"tenant-hooks-other-{secrets.token_hex(3)}")
    mine = endpoint(hc, key, "https://hooks.example.com/a")
    for method, path in (
        ("get", f"/v1/webhook_endpoints/{mine['id']}"),
        ("delete", f"/v1/webhook_endpoints/{mine['id']}"),
        ("post", f"/v1/webhook_endpoints/{mine['id']}/rotate_secret"),
        ("get", f"/v1/webhook_endpoints/{mine['id']}/deliveries"),
    ):
        assert getattr(hc, method)(path, headers=auth(other)).status_code == 404, path
    assert hc.get("/v1/webhook_endpoints", headers=auth(other)).get_json()["data"] == []


def test_bad_fields_and_the_per_tenant_cap(hc: FlaskClient, key: str) -> None:
    for body in (
        {"url": "https://a.example.com/", "event_types": ["batch.exploded"]},
        {"url": "https://a.example.com/", "event_types": []},
        {"url": "ftp://a.example.com/", "event_types": ["job.failed"]},
        {"event_types": ["job.failed"]},
    ):
        assert hc.post("/v1/webhook_endpoints", json=body, headers=auth(key)).status_code == 400, body
    for i in range(3):
        endpoint(hc, key, f"https://a.example.com/{i}")
    r = hc.post(
        "/v1/webhook_endpoints", json={"url": "https://a.example.com/4", "events": ALL}, headers=auth(key)
    )
    assert r.status_code == 400 and r.get_json()["error"]["code"] == "webhook_endpoint_limit"


def test_private_destinations_are_refused_unless_an_operator_allows_them(
    client: FlaskClient, tenant_keys: dict[str, str], hc: FlaskClient, key: str
) -> None:
    for url in (
        "http://127.0.0.1:8080/x",
        "http://10.0.0.7/",
        "http://169.254.169.254/",
        "http://localhost/",
    ):
        r = client.post(
            "/v1/webhook_endpoints", json={"url": url, "event_types": ALL}, headers=auth(tenant_keys["a"])
        )
        assert r.status_code == 400 and r.get_json()["error"]["param"] == "url", url
    endpoint(hc, key, "http://127.0.0.1:8080/x")  # LLMQ_WEBHOOK_ALLOW_PRIVATE=true


# --- the outbox --------------------------------------------------------------------------


def _single_job(services: Services, key: str) -> str:
    principal = services.keys.authenticate(key)
    req = ChatCompletionV2Request.model_validate(
        {"model": "api-only", "messages": [{"role": "user", "content": "x"}]}
    )
    return services.jobs.submit_request(principal, req).id


def _batch(hc: FlaskClient, key: str, n: int) -> str:
    f = upload(hc, key, jsonl([line(i) for i in range(n)])).get_json()
    return str(create(hc, key, f["id"]).get_json()["id"])


def test_events_are_written_with_the_changes_that_cause_them(
    hc: FlaskClient, hooks: Services, key: str
) -> None:
    wanted = endpoint(hc, key, "http://127.0.0.1:9/all")
    picky = endpoint(hc, key, "http://127.0.0.1:9/picky", ["batch.cancelled"])
    store = JobStore(hooks.db)

    # A single job cancelled while queued (the API), one that succeeds and one that fails
    # (the worker's bulk write), one whose lease lapsed with attempts spent (the sweeper).
    cancelled = _single_job(hooks, key)
    assert hc.post(f"/v2/jobs/{cancelled}/cancel", headers=auth(key)).status_code == 200
    ok, bad, lost = (_single_job(hooks, key) for _ in range(3))
    claims = {c.job_id: c for c in store.claim_many([ok, bad, lost], "w1", 30, 1)}
    store.finish_many(
        [
            Result(ok, claims[ok].epoch, "succeeded", response={"choices": []}),
            Result(bad, claims[bad].epoch, "failed", error={"error": {"message": "x"}}),
        ]
    )
    with hooks.db.session() as s:
        s.execute(
            text("UPDATE jobs SET lease_expires_at = now() - interval '1 s' WHERE id = :j"), {"j": lost}
        )
    store.expire_leases(max_attempts=1)

    # A batch: its lines end as the worker writes them (no job events), the batch is
    # cancelled and finalized (one batch event).
    batch_id = _batch(hc, key, 3)
    with hooks.db.session() as s:
        line_ids = list(s.scalars(text("SELECT id FROM jobs WHERE batch_id = :b"), {"b": batch_id}))
    line_claims = store.claim_many(line_ids[:1], "w1", 30, 3)
    store.finish_many([Result(line_claims[0].job_id, line_claims[0].epoch, "succeeded", response={})])
    assert hc.post(f"/v1/batches/{batch_id}/cancel", headers=auth(key)).status_code == 200
    BatchLifecycle(hooks.db, hooks.queue, hooks.events, window=8, chunk=8).finalize_done()

    got = {(d["type"], d["data"]["id"]) for d in deliveries(hc, key, wanted["id"])}
    assert got == {
        ("job.cancelled", cancelled),
        ("job.succeeded", ok),
        ("job.failed", bad),
        ("job.failed", lost),
        ("batch.cancelled", batch_id),
    }
    (only,) = deliveries(hc, key, picky["id"])
    assert (only["type"], only["data"]["id"], only["status"]) == ("batch.cancelled", batch_id, "pending")
    batch_event = next(d for d in deliveries(hc, key, wanted["id"]) if d["type"] == "batch.cancelled")
    assert batch_event["id"] == only["id"]  # one event, one id, for every endpoint


def test_a_tenant_without_endpoints_writes_nothing(hc: FlaskClient, hooks: Services) -> None:
    lonely = hooks.keys.create_key(f"tenant-hooks-none-{secrets.token_hex(3)}")
    job = _single_job(hooks, lonely)
    hc.post(f"/v2/jobs/{job}/cancel", headers=auth(lonely))
    with hooks.db.session() as s:
        assert (
            s.scalar(text("SELECT count(*) FROM webhook_deliveries WHERE subject_id = :j"), {"j": job}) == 0
        )


# --- delivery ----------------------------------------------------------------------------


def _verify_all(receiver: Receiver, secret: str) -> dict[str, dict[str, Any]]:
    """Every request received, verified by both verifiers; the events by id."""
    events = {}
    for r in receiver.snapshot():
        event = standardwebhooks.Webhook(secret).verify(r.body, r.headers)
        SDK.webhooks.unwrap(r.body, r.headers, secret=secret)
        assert event["id"] == r.headers["webhook-id"] and event["object"] == "event"
        events[event["id"]] = event
    return events


def test_a_receiver_down_for_a_while_gets_every_event_when_it_returns(
    hc: FlaskClient, hooks: Services, key: str
) -> None:
    receiver = Receiver()
    hook = endpoint(hc, key, receiver.url)
    jobs = [_single_job(hooks, key) for _ in range(5)]
    for job in jobs:
        hc.post(f"/v2/jobs/{job}/cancel", headers=auth(key))
    sender = deliverer(hooks, base=0.2, cap=1.0, lifetime=600)
    try:
        down_until = time.monotonic() + 10
        while time.monotonic() < down_until:
            sender.drain(timeout=5)
            time.sleep(0.2)
        pending = deliveries(hc, key, hook["id"])
        assert all(d["status"] == "pending" and d["attempts"] >= 3 for d in pending), pending
        assert all("ConnectError" in (d["last_error"] or "") for d in pending)
        receiver.start()
        deadline = time.monotonic() + 15
        while len(receiver.event_ids()) < len(jobs) and time.monotonic() < deadline:
            sender.drain(timeout=5)
            time.sleep(0.2)
    finally:
        receiver.stop()
        sender.close()
    events = _verify_all(receiver, hook["signing_secret"])
    assert {e["data"]["id"] for e in events.values()} == set(jobs)
    assert all(e["type"] == "job.cancelled" for e in events.values())
    done = deliveries(hc, key, hook["id"], status="delivered")
    assert {d["id"] for d in done} == set(events) and all(d["next_attempt_at"] is None for d in done)


def test_a_receiver_that_never_answers_2xx_ends_failed_and_visible(
    hc: FlaskClient, hooks: Services, key: str
) -> None:
    receiver = Receiver(status=500).start()
    hook = endpoint(hc, key, receiver.url, ["job.cancelled"])
    job = _single_job(hooks, key)
    hc.post(f"/v2/jobs/{job}/cancel", headers=auth(key))
    sender = deliverer(hooks, base=0.2, cap=0.5, lifetime=2)
    try:
        deadline = time.monotonic() + 15
        while not deliveries(hc, key, hook["id"], status="failed") and time.monotonic() < deadline:
            sender.drain(timeout=5)
            time.sleep(0.2)
    finally:
        receiver.stop()
        sender.close()
    (failed,) = deliveries(hc, key, hook["id"], status="failed")
    assert failed["attempts"] >= 3 and failed["last_status_code"] == 500
    assert failed["last_error"].startswith("HTTP 500") and failed["failed_at"] is not None
    assert len(receiver.event_ids()) == 1  # the same event id on every attempt


def test_a_redirect_is_not_followed(hc: FlaskClient, hooks: Services, key: str) -> None:
    receiver = Receiver(status=307).start()
    hook = endpoint(hc, key, receiver.url, ["job.cancelled"])
    hc.post(f"/v2/jobs/{_single_job(hooks, key)}/cancel", headers=auth(key))
    sender = deliverer(hooks, base=60)
    try:
        sender.drain(timeout=5)
    finally:
        receiver.stop()
        sender.close()
    (d,) = deliveries(hc, key, hook["id"])
    assert d["status"] == "pending" and d["last_status_code"] == 307 and "redirect" in d["last_error"]


def test_rotation_with_grace_signs_with_both_secrets(hc: FlaskClient, hooks: Services, key: str) -> None:
    receiver = Receiver().start()
    hook = endpoint(hc, key, receiver.url, ["job.cancelled"])
    rotated = hc.post(
        f"/v1/webhook_endpoints/{hook['id']}/rotate_secret",
        json={"keep_old_secret_active_for_24_hours": True},
        headers=auth(key),
    ).get_json()
    hc.post(f"/v2/jobs/{_single_job(hooks, key)}/cancel", headers=auth(key))
    sender = deliverer(hooks)
    try:
        sender.drain(timeout=5)
    finally:
        receiver.stop()
        sender.close()
    assert len(_verify_all(receiver, hook["signing_secret"])) == 1
    assert len(_verify_all(receiver, rotated["signing_secret"])) == 1
