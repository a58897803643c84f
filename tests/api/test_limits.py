"""Idempotency keys (R12), per-key rate limits (X7) and the per-tenant cap on active jobs."""

from __future__ import annotations

import secrets
import threading
from datetime import timedelta

import pytest
from flask.testing import FlaskClient
from sqlalchemy import text

from app.api import create_app
from app.container import build_services
from app.services.idempotency import IdempotencyKey
from tests.helpers import Stores, auth, make_settings


def body(**fields) -> dict:
    return {"model": "api-only", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **fields}


@pytest.fixture
def key(services) -> tuple[str, str]:  # type: ignore[no-untyped-def]
    tenant = f"tenant-limits-{secrets.token_hex(3)}"
    return tenant, services.keys.create_key(tenant)


def post(client: FlaskClient, api_key: str, idem: str | None, payload: dict, path: str = "/v2/jobs"):  # type: ignore[no-untyped-def]
    headers = auth(api_key) | ({"Idempotency-Key": idem} if idem else {})
    return client.post(path, json=payload, headers=headers)


def test_same_key_same_body_replays_the_same_job(client: FlaskClient, key) -> None:
    _, api_key = key
    first = post(client, api_key, "order-1", body())
    again = post(client, api_key, "order-1", body())
    assert first.status_code == again.status_code == 202
    assert first.get_json()["id"] == again.get_json()["id"]
    other = post(client, api_key, "order-2", body())
    assert other.get_json()["id"] != first.get_json()["id"]


def test_same_key_other_body_is_422(client: FlaskClient, key) -> None:
    _, api_key = key
    post(client, api_key, "k", body())
    r = post(client, api_key, "k", body(max_tokens=4))
    assert r.status_code == 422
    assert r.get_json()["error"]["param"] == "Idempotency-Key"
    assert r.get_json()["error"]["code"] == "idempotency_key_reused"


def test_concurrent_duplicate_is_409(client: FlaskClient, key, services) -> None:
    tenant, api_key = key
    idem = IdempotencyKey.from_header("busy", "/v2/jobs", body())
    with services.jobs._locks.hold(tenant, idem):  # another request is handling this key
        r = post(client, api_key, "busy", body())
    assert r.status_code == 409 and r.get_json()["error"]["code"] == "idempotency_key_in_use"
    assert post(client, api_key, "busy", body()).status_code == 202


def test_keys_are_per_tenant_and_expire(client: FlaskClient, key, services) -> None:
    _, api_key = key
    other = services.keys.create_key(f"tenant-limits-other-{secrets.token_hex(3)}")
    a = post(client, api_key, "shared", body()).get_json()["id"]
    b = post(client, other, "shared", body()).get_json()["id"]
    assert a != b
    with services.db.session() as s:
        s.execute(
            text("UPDATE jobs SET created_at = created_at - :age WHERE id = :id"),
            {"age": timedelta(days=2), "id": a},
        )
    assert post(client, api_key, "shared", body(max_tokens=9)).get_json()["id"] != a  # expired: a new request


def test_idempotent_batch_create(client: FlaskClient, key) -> None:
    import io
    import json

    _, api_key = key
    line = {"custom_id": "x", "method": "POST", "url": "/v1/chat/completions", "body": body()}
    f = client.post(
        "/v1/files",
        data={"purpose": "batch", "file": (io.BytesIO(json.dumps(line).encode() + b"\n"), "f.jsonl")},
        headers=auth(api_key),
        content_type="multipart/form-data",
    ).get_json()
    payload = {"input_file_id": f["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    first = post(client, api_key, "batch-1", payload, "/v1/batches").get_json()
    again = post(client, api_key, "batch-1", payload, "/v1/batches").get_json()
    assert first["id"] == again["id"]
    assert (
        post(client, api_key, "batch-1", {**payload, "completion_window": "1h"}, "/v1/batches").status_code
        == 422
    )


def test_bad_idempotency_key(client: FlaskClient, key) -> None:
    _, api_key = key
    r = post(client, api_key, "x" * 300, body())
    assert r.status_code == 400 and r.get_json()["error"]["param"] == "Idempotency-Key"


def test_one_key_flooding_gets_429_and_others_do_not(stores: Stores) -> None:
    settings = make_settings(stores, rate_limit_per_minute=60, rate_limit_burst=3)
    services = build_services(settings)
    client = create_app(services=services).test_client()
    flood = services.keys.create_key(f"tenant-flood-{secrets.token_hex(3)}")
    calm = services.keys.create_key(f"tenant-calm-{secrets.token_hex(3)}")
    codes = [client.get("/v2/jobs", headers=auth(flood)).status_code for _ in range(5)]
    assert codes[:3] == [200, 200, 200] and codes[3:] == [429, 429]
    limited = client.get("/v2/jobs", headers=auth(flood))
    assert int(limited.headers["Retry-After"]) >= 1
    assert limited.get_json()["error"]["type"] == "rate_limit_error"
    assert client.get("/v2/jobs", headers=auth(calm)).status_code == 200
    services.close()


def test_active_job_cap_per_tenant(stores: Stores) -> None:
    settings = make_settings(stores, max_active_jobs_per_tenant=2)
    services = build_services(settings)
    client = create_app(services=services).test_client()
    api_key = services.keys.create_key(f"tenant-cap-{secrets.token_hex(3)}")
    assert [post(client, api_key, None, body()).status_code for _ in range(3)] == [202, 202, 429]
    services.close()


def test_submits_far_from_the_cap_do_not_wait_for_each_other(stores: Stores) -> None:
    """Far from its cap, a tenant's submit takes the cap lock shared: another transaction
    holding it shared (an unfinished submit of the same tenant) does not hold it up. Held
    exclusively, 64 concurrent submits of one tenant waited 0.4 s each for each other."""
    services = build_services(make_settings(stores, max_active_jobs_per_tenant=10_000))
    client = create_app(services=services).test_client()
    tenant = f"tenant-shared-{secrets.token_hex(3)}"
    api_key = services.keys.create_key(tenant)
    done: list[int] = []
    try:
        with services.db.session() as s:  # a submit of the same tenant, still open
            s.execute(
                text("SELECT pg_advisory_xact_lock_shared(hashtextextended(:k, 0))"),
                {"k": f"llmq:tenant-cap:{tenant}"},
            )
            worker = threading.Thread(
                target=lambda: done.append(post(client, api_key, None, body()).status_code)
            )
            worker.start()
            worker.join(10)
            assert done == [202]
    finally:
        services.close()


def test_concurrent_submits_near_the_cap_stop_exactly_at_it(stores: Stores) -> None:
    """Submits with fewer than max_connections places left count under the exclusive lock;
    those before them took it shared: 40 concurrent submits for the last 10 places of a cap
    above max_connections get 10 acceptances."""
    probe = build_services(make_settings(stores))
    with probe.db.session() as s:
        bound = int(s.scalar(text("SELECT current_setting('max_connections')::int")) or 0)
    probe.close()
    cap = bound + 10
    services = build_services(make_settings(stores, max_active_jobs_per_tenant=cap, db_pool_size=16))
    app = create_app(services=services)
    tenant = f"tenant-near-{secrets.token_hex(3)}"
    api_key = services.keys.create_key(tenant)
    try:
        client = app.test_client()
        for _ in range(bound):  # the shared path all the way
            assert post(client, api_key, None, body()).status_code == 202
        start = threading.Barrier(40)
        codes: list[int] = []

        def submit() -> None:
            start.wait()
            codes.append(post(app.test_client(), api_key, None, body()).status_code)

        threads = [threading.Thread(target=submit) for _ in range(40)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert sorted(codes) == [202] * 10 + [429] * 30
        with services.db.session() as s:
            active = s.scalar(
                text("SELECT count(*) FROM jobs WHERE tenant_id = :t AND status = 'queued'"), {"t": tenant}
            )
        assert active == cap
    finally:
        services.close()


def wrong_key(client: FlaskClient, addr: str, forwarded: str | None = None) -> int:
    headers = auth("llmq-wrong-" + secrets.token_hex(8)) | (
        {"X-Forwarded-For": forwarded} if forwarded else {}
    )
    return client.get("/v2/jobs", headers=headers, environ_base={"REMOTE_ADDR": addr}).status_code


def test_wrong_keys_are_limited_per_address_and_a_right_key_still_works(stores: Stores) -> None:
    settings = make_settings(stores, auth_failures_per_minute=60, auth_failure_burst=3)
    services = build_services(settings)
    client = create_app(services=services).test_client()
    attacker = f"198.51.100.{secrets.randbelow(250)}"
    assert [wrong_key(client, attacker) for _ in range(5)] == [401, 401, 401, 429, 429]
    limited = client.get("/v2/jobs", environ_base={"REMOTE_ADDR": attacker})  # no key at all
    assert limited.status_code == 429 and int(limited.headers["Retry-After"]) >= 1
    assert limited.get_json()["error"]["type"] == "rate_limit_error"
    assert "client address" in limited.get_json()["error"]["message"]
    # Successes are limited by the per-key limiter only: a tenant at the same address works.
    right = services.keys.create_key(f"tenant-authfail-{secrets.token_hex(3)}")
    ok = client.get("/v2/jobs", headers=auth(right), environ_base={"REMOTE_ADDR": attacker})
    assert ok.status_code == 200
    # Another address is not touched, and without trusted proxies X-Forwarded-For is ignored.
    assert wrong_key(client, "203.0.113.9") == 401
    assert wrong_key(client, attacker, forwarded="203.0.113.77") == 429
    services.close()


def test_trusted_proxy_hops_read_the_address_the_proxy_saw(stores: Stores) -> None:
    settings = make_settings(stores, auth_failures_per_minute=60, auth_failure_burst=2, trusted_proxy_hops=1)
    services = build_services(settings)
    client = create_app(services=services).test_client()
    proxy = "10.0.0.2"
    client_a = f"192.0.2.{secrets.randbelow(250)}"
    # The left part is the client's to forge; the proxy appended the address it saw.
    codes = [wrong_key(client, proxy, forwarded=f"{secrets.token_hex(2)}, {client_a}") for _ in range(3)]
    assert codes == [401, 401, 429]
    assert wrong_key(client, proxy, forwarded=f"{client_a}1") == 401  # another client, same proxy
    services.close()
