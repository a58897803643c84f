"""/metrics against real Postgres and Redis: two API replicas (two apps with their own
services and replica names, one database and one Redis) report the cluster figures once
between them, so `sum()` over both is the real queue; requests are counted by route (the
URL rule, never the raw path) and status; submits by model and kind; and the job object
carries its timings (null until a worker ends it)."""

from __future__ import annotations

import io
import json
import secrets
from collections.abc import Iterator

import pytest
from flask.testing import FlaskClient
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import text

from app.api import create_app
from app.container import Services, build_services
from app.services.metrics import LEASE_KEY
from tests.helpers import Stores, auth, make_settings


def samples(exposition: str, name: str, **labels: str) -> list[float]:
    return [
        float(s.value)
        for family in text_string_to_metric_families(exposition)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]


def scrape(client: FlaskClient) -> str:
    r = client.get("/metrics")
    assert r.status_code == 200 and r.mimetype == "text/plain"
    return r.get_data(as_text=True)


@pytest.fixture
def replicas(stores: Stores, services: Services) -> Iterator[list[tuple[Services, FlaskClient]]]:
    """Two replicas. The lease is freed first (this session's own app may hold it) and
    after (so the session's app reports again within a second)."""
    services.redis.delete(LEASE_KEY)
    built = [
        build_services(make_settings(stores, metrics_replica_id=f"replica-{name}", metrics_lease_seconds=1.0))
        for name in ("a", "b")
    ]
    yield [(s, create_app(services=s).test_client()) for s in built]
    services.redis.delete(LEASE_KEY)
    for s in built:
        s.close()


def queued_in_database(services: Services, model: str) -> int:
    with services.db.session() as s:
        count = s.scalar(
            text("SELECT count(*) FROM jobs WHERE status = 'queued' AND model = :m"), {"m": model}
        )
    return int(count or 0)


def test_two_replicas_report_the_cluster_figures_once(replicas, tenant_keys) -> None:  # type: ignore[no-untyped-def]
    (services, a), (_, b) = replicas
    for _ in range(3):
        r = a.post(
            "/v2/jobs",
            json={"model": "api-only", "messages": [{"role": "user", "content": "hi"}]},
            headers=auth(tenant_keys["a"]),
        )
        assert r.status_code == 202
    real = queued_in_database(services, "api-only")
    assert real >= 3
    for _ in range(3):  # every scrape, whichever order: one replica reports
        texts = [scrape(a), scrape(b)]
        assert sum(v for t in texts for v in samples(t, "llmq_cluster_reporter")) == 1
        assert sum(v for t in texts for v in samples(t, "llmq_model_queued_jobs", model="api-only")) == real
        active = [samples(t, "llmq_jobs_active", model="api-only", status="queued") for t in texts]
        assert sum(sum(v) for v in active) == real
        assert [bool(v) for v in active] == [True, False]  # the first scraped took the lease and keeps it
    # Each replica's own figures are its own: both send them.
    for t in texts:
        assert samples(t, "llmq_build_info", component="api") == [1.0]


def test_requests_are_counted_by_route_not_by_path(client: FlaskClient, tenant_keys) -> None:  # type: ignore[no-untyped-def]
    job_id = f"job_{secrets.token_hex(8)}"
    # A request is observed when its response is closed (as a WSGI server always does).
    with client.get(f"/v2/jobs/{job_id}", headers=auth(tenant_keys["a"])) as r:
        assert r.status_code == 404
    with client.get(f"/no/such/{job_id}") as r:
        assert r.status_code == 404
    with client.open("/healthz", method="BREW") as r:
        assert r.status_code == 405
    exposition = scrape(client)
    assert job_id not in exposition
    route = {"route": "/v2/jobs/<job_id>", "method": "GET", "status": "404"}
    assert samples(exposition, "llmq_http_requests_total", **route)[0] >= 1
    assert samples(exposition, "llmq_http_request_duration_seconds_count", **route)[0] >= 1
    assert (
        samples(exposition, "llmq_http_requests_total", route="unmatched", method="GET", status="404")[0] >= 1
    )
    assert (
        samples(exposition, "llmq_http_requests_total", route="unmatched", method="other", status="405")[0]
        >= 1
    )


def test_submits_are_counted_by_model_and_kind(client: FlaskClient, tenant_keys) -> None:  # type: ignore[no-untyped-def]
    def submitted(kind: str) -> float:
        return sum(samples(scrape(client), "llmq_jobs_submitted_total", model="api-only", kind=kind))

    single, lines = submitted("single"), submitted("batch_line")
    key = tenant_keys["b"]
    body = {"model": "api-only", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert client.post("/v2/jobs", json=body, headers=auth(key)).status_code == 202
    upload = b"".join(
        json.dumps(
            {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
        ).encode()
        + b"\n"
        for i in range(4)
    )
    f = client.post(
        "/v1/files",
        data={"purpose": "batch", "file": (io.BytesIO(upload), "in.jsonl")},
        headers=auth(key),
        content_type="multipart/form-data",
    )
    assert f.status_code == 200, f.get_json()
    batch = {
        "input_file_id": f.get_json()["id"],
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
    }
    assert client.post("/v1/batches", json=batch, headers=auth(key)).status_code == 200
    assert submitted("single") == single + 1
    assert submitted("batch_line") == lines + 4
    # The batch's lines are due within its 24 h window: the nearest deadline is no later.
    (deadline,) = samples(scrape(client), "llmq_model_deadline_seconds", model="api-only")
    assert 0 < deadline <= 24 * 3600


def test_a_queued_job_has_no_timings_yet(client: FlaskClient, tenant_keys) -> None:  # type: ignore[no-untyped-def]
    body = {"model": "api-only", "messages": [{"role": "user", "content": "hi"}]}
    job = client.post("/v2/jobs", json=body, headers=auth(tenant_keys["a"])).get_json()
    for name in ("queue_wait_seconds", "ttft_seconds", "e2e_seconds"):
        assert name in job and job[name] is None
