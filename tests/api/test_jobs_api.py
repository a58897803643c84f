"""The HTTP contract of /v2/jobs through the Flask app, against real Postgres and Redis
(no worker consumes the API tests' model, so jobs stay queued)."""

from __future__ import annotations

import json

import pytest
from flask.testing import FlaskClient

from app.schemas.jobs import ErrorResponse, JobList, JobObject
from tests.helpers import auth


def body(**fields) -> dict:
    return {
        "model": "api-only",
        "messages": [{"role": "user", "content": "Say hi"}],
        "max_tokens": 8,
        **fields,
    }


def assert_error(response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.get_data(as_text=True)
    err = ErrorResponse.model_validate(response.get_json()).error
    if param is not None:
        assert err.param == param
    return response.get_json()["error"]


def test_submit_returns_202_and_the_queued_job(client: FlaskClient, tenant_keys) -> None:
    r = client.post("/v2/jobs", json=body(metadata={"run": "7"}), headers=auth(tenant_keys["a"]))
    assert r.status_code == 202
    job = JobObject.model_validate(r.get_json())
    assert job.status == "queued"
    assert job.model == "api-only"
    assert job.metadata == {"run": "7"}
    got = client.get(f"/v2/jobs/{job.id}", headers=auth(tenant_keys["a"]))
    assert got.status_code == 200
    # The answer to the submit is the job as its first poll reads it, field for field.
    assert got.get_json() == r.get_json()


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic abc"}])
def test_missing_or_bad_key_is_401(client: FlaskClient, headers) -> None:
    for method, path in [
        ("post", "/v2/jobs"),
        ("get", "/v2/jobs"),
        ("get", "/v2/jobs/job_x"),
        ("post", "/v2/jobs/job_x/cancel"),
        ("get", "/v1/models"),
    ]:
        r = getattr(client, method)(path, json=body(), headers=headers)
        assert_error(r, 401)
        assert r.headers["WWW-Authenticate"].startswith("Bearer")


def test_revoked_key_is_401(client: FlaskClient, services) -> None:
    key = services.keys.create_key("tenant-revoked")
    assert client.get("/v2/jobs", headers=auth(key)).status_code == 200
    key_id = services.keys.list_keys("tenant-revoked")[0].id
    services.keys.revoke(key_id)
    assert_error(client.get("/v2/jobs", headers=auth(key)), 401)


def test_keys_are_stored_hashed(services, tenant_keys) -> None:
    from sqlalchemy import text

    with services.db.session() as s:
        stored = [r[0] for r in s.execute(text("SELECT key_hash FROM api_keys"))]
    assert tenant_keys["a"] not in stored
    assert all(len(h) == 64 for h in stored)


def test_other_tenants_ids_are_404(client: FlaskClient, tenant_keys) -> None:
    job_id = client.post("/v2/jobs", json=body(), headers=auth(tenant_keys["a"])).get_json()["id"]
    assert_error(client.get(f"/v2/jobs/{job_id}", headers=auth(tenant_keys["b"])), 404, "job_id")
    assert_error(client.post(f"/v2/jobs/{job_id}/cancel", headers=auth(tenant_keys["b"])), 404, "job_id")
    listed = client.get("/v2/jobs?limit=100", headers=auth(tenant_keys["b"])).get_json()
    assert job_id not in [j["id"] for j in listed["data"]]
    # and tenant A still sees it queued
    assert client.get(f"/v2/jobs/{job_id}", headers=auth(tenant_keys["a"])).get_json()["status"] == "queued"


@pytest.mark.parametrize(
    ("payload", "param"),
    [
        (body(frobnicate=True), "frobnicate"),
        (body(temperature="hot"), "temperature"),
        (body(messages=[{"role": "user", "content": 12}]), "messages[0].content"),
        (body(messages=[{"role": "user"}]), "messages[0].content"),
        (body(messages=[]), "messages"),
        ({"messages": [{"role": "user", "content": "x"}]}, "model"),
        (body(n=0), "n"),
        (body(n=1000), "n"),
        (body(n=10**9), "n"),
        (body(messages=[{"role": "user", "content": "x"}] * 2_000), "messages"),
        (body(max_tokens=10**9), "max_tokens"),
        (body(top_logprobs=21), "top_logprobs"),
        (body(use_beam_search=True), "use_beam_search"),
        (body(top_logprobs=3), "top_logprobs"),
        (body(tools=[{"type": "function", "function": {"name": "f"}}]), "tool_choice"),
        (body(chat_template="{{ messages }}"), "chat_template"),
        (body(stop=["a", "b", "c", "d", "e"]), "stop"),
        (body(guided_whitespace_pattern=" "), "guided_whitespace_pattern"),
        (body(guided_json={"type": "object"}, guided_regex="a"), "guided_regex"),
    ],
)
def test_bad_requests_are_400_naming_the_field(client: FlaskClient, tenant_keys, payload, param) -> None:
    r = client.post("/v2/jobs", json=payload, headers=auth(tenant_keys["a"]))
    err = assert_error(r, 400, param)
    assert err["type"] == "invalid_request_error"
    assert param.split("[")[0] in err["message"] or param in err["message"]


def test_unknown_model_is_404_naming_model(client: FlaskClient, tenant_keys) -> None:
    assert_error(
        client.post("/v2/jobs", json=body(model="gpt-9"), headers=auth(tenant_keys["a"])), 404, "model"
    )


def test_malformed_json_is_400(client: FlaskClient, tenant_keys) -> None:
    r = client.post(
        "/v2/jobs",
        data=b'{"model": "api-only", ',
        headers=auth(tenant_keys["a"]),
        content_type="application/json",
    )
    err = assert_error(r, 400)
    assert err["code"] == "invalid_json"


def test_oversized_body_is_413(client: FlaskClient, tenant_keys, settings) -> None:
    huge = json.dumps(body(messages=[{"role": "user", "content": "x" * (settings.max_body_bytes + 10)}]))
    r = client.post("/v2/jobs", data=huge, headers=auth(tenant_keys["a"]), content_type="application/json")
    assert_error(r, 413)


def test_a_job_body_over_the_render_bound_is_413(client: FlaskClient, tenant_keys, settings) -> None:
    """Between `max_request_bytes` and `max_body_bytes` a body would be stored and then fail
    in the worker; a single job is refused up front instead (a batch line fails alone)."""
    assert settings.max_request_bytes < settings.max_body_bytes
    size = settings.max_request_bytes + 10
    big = json.dumps(body(messages=[{"role": "user", "content": "x" * size}]))
    for path in ("/v2/jobs", "/v1/chat/completions"):
        r = client.post(path, data=big, headers=auth(tenant_keys["a"]), content_type="application/json")
        assert f"limit is {settings.max_request_bytes} bytes" in assert_error(r, 413)["message"]


def test_deep_nesting_is_400(client: FlaskClient, tenant_keys) -> None:
    deep = '{"model": "api-only", "metadata": ' + '{"a": ' * 5000 + "1" + "}" * 5000 + "}"
    r = client.post("/v2/jobs", data=deep, headers=auth(tenant_keys["a"]), content_type="application/json")
    assert assert_error(r, 400)["code"] == "too_deep"


def test_nothing_is_stored_for_a_rejected_request(client: FlaskClient, services) -> None:
    from sqlalchemy import text

    key = services.keys.create_key("tenant-rejects")
    client.post("/v2/jobs", json=body(frobnicate=1), headers=auth(key))
    with services.db.session() as s:
        count = s.execute(text("SELECT count(*) FROM jobs WHERE tenant_id = 'tenant-rejects'")).scalar()
    assert count == 0


def test_list_is_cursor_paginated_newest_first(client: FlaskClient, services) -> None:
    key = services.keys.create_key("tenant-pages")
    ids = [client.post("/v2/jobs", json=body(), headers=auth(key)).get_json()["id"] for _ in range(5)]
    page1 = JobList.model_validate(client.get("/v2/jobs?limit=2", headers=auth(key)).get_json())
    assert [j.id for j in page1.data] == ids[::-1][:2]
    assert page1.has_more
    page2 = JobList.model_validate(
        client.get(f"/v2/jobs?limit=2&after={page1.last_id}", headers=auth(key)).get_json()
    )
    page3 = JobList.model_validate(
        client.get(f"/v2/jobs?limit=2&after={page2.last_id}", headers=auth(key)).get_json()
    )
    assert [j.id for j in page2.data + page3.data] == ids[::-1][2:]
    assert not page3.has_more


def test_list_filters_by_status_and_rejects_unknown_status(client: FlaskClient, services) -> None:
    key = services.keys.create_key("tenant-filter")
    a = client.post("/v2/jobs", json=body(), headers=auth(key)).get_json()["id"]
    b = client.post("/v2/jobs", json=body(), headers=auth(key)).get_json()["id"]
    client.post(f"/v2/jobs/{a}/cancel", headers=auth(key))
    cancelled = client.get("/v2/jobs?status=cancelled", headers=auth(key)).get_json()["data"]
    queued = client.get("/v2/jobs?status=queued", headers=auth(key)).get_json()["data"]
    assert [j["id"] for j in cancelled] == [a]
    assert [j["id"] for j in queued] == [b]
    assert_error(client.get("/v2/jobs?status=bogus", headers=auth(key)), 400, "status")
    assert_error(client.get("/v2/jobs?limit=0", headers=auth(key)), 400, "limit")
    assert_error(client.get("/v2/jobs?limit=abc", headers=auth(key)), 400, "limit")


def test_cancel_queued_job_is_immediate_and_idempotent(client: FlaskClient, tenant_keys) -> None:
    job_id = client.post("/v2/jobs", json=body(), headers=auth(tenant_keys["a"])).get_json()["id"]
    r = client.post(f"/v2/jobs/{job_id}/cancel", headers=auth(tenant_keys["a"]))
    assert r.status_code == 200
    job = r.get_json()
    assert job["status"] == "cancelled"
    assert job["cancelled_at"] is not None
    again = client.post(f"/v2/jobs/{job_id}/cancel", headers=auth(tenant_keys["a"]))
    assert again.status_code == 200 and again.get_json()["status"] == "cancelled"


def test_models_lists_the_served_model(client: FlaskClient, tenant_keys) -> None:
    data = client.get("/v1/models", headers=auth(tenant_keys["a"])).get_json()
    assert data["object"] == "list"
    assert [m["id"] for m in data["data"]] == ["api-only"]


def test_unknown_route_and_wrong_method_use_the_error_shape(client: FlaskClient) -> None:
    assert_error(client.get("/v9/nothing"), 404)
    assert_error(client.delete("/healthz"), 405)


def test_healthz_and_readyz(client: FlaskClient) -> None:
    assert client.get("/healthz").get_json() == {"status": "ok"}
    ready = client.get("/readyz").get_json()
    assert ready["checks"]["database"]["ok"] is True
    assert ready["checks"]["redis"]["ok"] is True


def test_openapi_is_generated_from_the_models(client: FlaskClient) -> None:
    spec = client.get("/openapi.json").get_json()
    assert spec["openapi"].startswith("3.1")
    schema = spec["components"]["schemas"]["ChatCompletionV2Request"]
    assert "guided_json" in schema["properties"] and "messages" in schema["required"]
    assert "/v2/jobs/{job_id}/cancel" in spec["paths"]
    for path in spec["paths"].values():
        for op in path.values():
            assert "400" in op["responses"] and "401" in op["responses"]


def test_nul_characters_are_stored_exactly(client: FlaskClient, tenant_keys) -> None:
    payload = body(messages=[{"role": "user", "content": "a\u0000b"}], metadata={"k": "v"})
    r = client.post("/v2/jobs", json=payload, headers=auth(tenant_keys["a"]))
    assert r.status_code == 202, r.get_data(as_text=True)
    job = client.get(f"/v2/jobs/{r.get_json()['id']}", headers=auth(tenant_keys["a"])).get_json()
    assert job["metadata"] == {"k": "v"}


def test_nul_in_metadata_is_a_400_naming_the_pair(client: FlaskClient, tenant_keys) -> None:
    """Metadata is indexed as jsonb for the list filters, and jsonb cannot hold U+0000."""
    r = client.post("/v2/jobs", json=body(metadata={"k": "\u0000"}), headers=auth(tenant_keys["a"]))
    assert r.status_code == 400 and r.get_json()["error"]["param"] == "metadata.k"


def test_metrics_count_active_work_without_auth(client: FlaskClient, tenant_keys) -> None:
    def sample(text: str, prefix: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))

    prefix = 'llmq_jobs_active{kind="single",model="api-only",status="queued"}'
    before = sample(client.get("/metrics").get_data(as_text=True), prefix)
    assert client.post("/v2/jobs", json=body(), headers=auth(tenant_keys["a"])).status_code == 202
    r = client.get("/metrics")
    assert r.status_code == 200 and r.mimetype == "text/plain"
    text = r.get_data(as_text=True)
    assert sample(text, prefix) == before + 1
    assert "llmq_database_up 1" in text and "llmq_redis_up 1" in text
    assert sample(text, 'llmq_queue_depth{model="api-only"}') >= 1
    for line in text.splitlines():  # the exposition format: comments or `name{labels} value`
        assert line.startswith("# ") or float(line.rsplit(" ", 1)[1]) >= 0


def test_openapi_lists_every_route(app, client: FlaskClient) -> None:  # type: ignore[no-untyped-def]
    spec = client.get("/openapi.json").get_json()["paths"]
    public = {"/healthz", "/readyz", "/openapi.json", "/metrics", "/console/", "/console/<name>"}
    for rule in app.url_map.iter_rules():
        if rule.endpoint == "static" or rule.rule in public:
            continue
        path = rule.rule.replace("<", "{").replace(">", "}")
        for method in (rule.methods or set()) - {"HEAD", "OPTIONS"}:
            assert method.lower() in spec.get(path, {}), (method, path)
