"""X1 and X2 over every route the app serves, read from its URL map so a new route is
covered the day it is added: without a valid key every route is 401 (SSE and file content
included); with tenant B's key, every id of tenant A is 404 and no byte of A's data shows."""

from __future__ import annotations

import io
import secrets
from collections.abc import Iterator

import pytest
from flask import Flask
from flask.testing import FlaskClient

from tests.helpers import auth, jsonl, line, upload

# The console's files are public: they hold no data (tests/api/test_console.py).
PUBLIC = {"/healthz", "/readyz", "/openapi.json", "/metrics", "/console/", "/console/<name>"}
SECRET = f"tenant-a-secret-{secrets.token_hex(4)}"


def routes(app: Flask) -> Iterator[tuple[str, str]]:
    for rule in app.url_map.iter_rules():
        if rule.endpoint == "static" or rule.rule in PUBLIC:
            continue
        for method in sorted((rule.methods or set()) - {"HEAD", "OPTIONS"}):
            yield method, rule.rule


def test_the_route_list_is_the_whole_api(app: Flask) -> None:
    listed = set(routes(app))
    assert ("GET", "/v2/jobs/<job_id>/stream") in listed
    assert ("GET", "/v1/files/<file_id>/content") in listed
    assert len(listed) >= 20


@pytest.fixture(scope="module")
def owned(app: Flask, services) -> dict[str, str]:  # type: ignore[no-untyped-def]
    """Tenant A's job, file and batch, each holding SECRET."""
    key = services.keys.create_key(f"tenant-x1-a-{secrets.token_hex(3)}")
    client = app.test_client()
    job = client.post(
        "/v2/jobs",
        json={"model": "api-only", "messages": [{"role": "user", "content": SECRET}], "max_tokens": 4},
        headers=auth(key),
    ).get_json()
    f = upload(client, key, jsonl([line(0, messages=[{"role": "user", "content": SECRET}])])).get_json()
    batch = client.post(
        "/v1/batches",
        json={"input_file_id": f["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"},
        headers=auth(key),
    ).get_json()
    hook = client.post(
        "/v1/webhook_endpoints",
        json={"url": "https://93.184.216.34/hooks", "event_types": ["batch.completed"], "name": SECRET},
        headers=auth(key),
    ).get_json()
    return {
        "job_id": job["id"],
        "file_id": f["id"],
        "batch_id": batch["id"],
        "endpoint_id": hook["id"],
        "key": key,
    }


def call(client: FlaskClient, method: str, rule: str, ids: dict[str, str], headers: dict[str, str]):  # type: ignore[no-untyped-def]
    path = rule
    for name in ("job_id", "file_id", "batch_id", "endpoint_id"):
        path = path.replace(f"<{name}>", ids[name])
    json_body = {
        "model": "api-only",
        "messages": [{"role": "user", "content": "hi"}],
        "input_file_id": ids["file_id"],
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
    }
    if rule == "/v1/files" and method == "POST":
        return client.post(
            path,
            data={"purpose": "batch", "file": (io.BytesIO(jsonl([line(0)])), "x.jsonl")},
            headers=headers,
            content_type="multipart/form-data",
        )
    return client.open(path, method=method, json=json_body if method == "POST" else None, headers=headers)


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer llmq_wrong"}, {"Authorization": "Basic dXNlcjpwYXNz"}, "revoked"],
    ids=["missing", "wrong", "not-bearer", "revoked"],
)
def test_x2_every_route_is_401_without_a_valid_key(app: Flask, services, owned, headers) -> None:  # type: ignore[no-untyped-def]
    if headers == "revoked":
        tenant = f"tenant-x2-{secrets.token_hex(3)}"
        key = services.keys.create_key(tenant)
        services.keys.revoke(services.keys.list_keys(tenant)[0].id)
        headers = auth(key)
    client = app.test_client()
    wrong = []
    for method, rule in routes(app):
        r = call(client, method, rule, owned, headers)
        body = r.get_data()
        if r.status_code != 401 or SECRET.encode() in body or "error" not in (r.get_json(silent=True) or {}):
            wrong.append((method, rule, r.status_code, body[:200]))
    assert wrong == []


def test_x1_every_id_of_tenant_a_is_404_for_tenant_b(app: Flask, services, owned) -> None:  # type: ignore[no-untyped-def]
    other = auth(services.keys.create_key(f"tenant-x1-b-{secrets.token_hex(3)}"))
    client = app.test_client()
    wrong = []
    for method, rule in routes(app):
        if "<" not in rule:
            continue
        r = call(client, method, rule, owned, other)
        if r.status_code != 404 or SECRET.encode() in r.get_data():
            wrong.append((method, rule, r.status_code, r.get_data()[:200]))
    # A's ids inside bodies and queries: a batch from A's file, B's lists.
    r = client.post(
        "/v1/batches",
        json={
            "input_file_id": owned["file_id"],
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        },
        headers=other,
    )
    if r.status_code != 404:
        wrong.append(("POST", "/v1/batches with A's file", r.status_code, r.get_data()[:200]))
    for path in (
        "/v2/jobs?limit=100",
        f"/v2/jobs?batch_id={owned['batch_id']}",
        "/v1/files",
        "/v1/batches",
        "/v1/webhook_endpoints",
    ):
        r = client.get(path, headers=other)
        body = r.get_data()
        if (
            any(owned[k].encode() in body for k in ("job_id", "file_id", "batch_id", "endpoint_id"))
            or SECRET.encode() in body
        ):
            wrong.append(("GET", path, r.status_code, body[:200]))
    assert wrong == []
    # and A still has all of it
    a = auth(owned["key"])
    assert client.get(f"/v2/jobs/{owned['job_id']}", headers=a).status_code == 200
    assert SECRET.encode() in client.get(f"/v1/files/{owned['file_id']}/content", headers=a).get_data()


def test_fuzz_findings_stay_fixed(app: Flask, services, owned) -> None:  # type: ignore[no-untyped-def]
    """What schemathesis and hypothesis found: a NUL in an id, cursor or body id was a 500
    (Postgres text cannot hold it); non-ASCII digits passed as a Last-Event-ID."""
    client = app.test_client()
    a = auth(owned["key"])
    for path in ("/v2/jobs/job_%00x", "/v1/batches?after=%00", "/v2/jobs?batch_id=b%00"):
        r = client.get(path, headers=a)
        assert r.status_code == 400 and r.get_json()["error"]["type"] == "invalid_request_error", path
    r = client.post(
        "/v1/batches",
        json={"input_file_id": "file_\u0000", "endpoint": "/v1/chat/completions", "completion_window": "24h"},
        headers=a,
    )
    assert r.status_code == 400 and r.get_json()["error"]["param"] == "input_file_id"
    r = client.get(f"/v2/jobs/{owned['job_id']}/stream", headers={**a, "Last-Event-ID": "\u0661-\u0662"})
    assert r.status_code == 400 and r.get_json()["error"]["param"] == "Last-Event-ID"
