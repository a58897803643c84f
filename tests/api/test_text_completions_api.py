"""Text completions, Scale's v1 completions and HTTP Basic auth through the Flask app,
against real Postgres and Redis (no worker: jobs stay queued)."""

from __future__ import annotations

import base64
import secrets
from collections.abc import Iterator
from typing import Any

import pytest
from flask.testing import FlaskClient
from sqlalchemy import text

from app.api import create_app
from app.container import Services, build_services
from app.schemas.batches import BatchObject
from app.services.batch_transitions import materialize
from tests.helpers import TINY_DIR, Stores, auth, create, jsonl, make_settings, upload


@pytest.fixture(scope="module")
def quick(stores: Stores) -> Iterator[Services]:
    """`api-only` with the tiny model's tokenizer readable here (prompts are counted before
    queuing; its context is 2,048 tokens) and a short sync wait (nothing runs the jobs)."""
    services = build_services(make_settings(stores, model=str(TINY_DIR), sync_wait_seconds=0.05))
    yield services
    services.close()


@pytest.fixture(scope="module")
def client(quick: Services) -> FlaskClient:  # type: ignore[override]
    return create_app(services=quick).test_client()


@pytest.fixture
def services(quick: Services) -> Services:  # type: ignore[override]
    return quick


@pytest.fixture
def tenant(quick: Services) -> tuple[str, str]:
    name = f"tenant-cmpl-{secrets.token_hex(3)}"
    return name, quick.keys.create_key(name)


def basic(user: str, password: str = "") -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


def completion(client: FlaskClient, key: str, **body: Any):  # type: ignore[no-untyped-def]
    return client.post(
        "/v1/completions", json={"model": "api-only", "prompt": "hi", **body}, headers=auth(key)
    )


def job_kinds(services, tenant: str) -> list[str]:  # type: ignore[no-untyped-def]
    with services.db.session() as s:
        rows = s.execute(text("SELECT kind FROM jobs WHERE tenant_id = :t ORDER BY id"), {"t": tenant})
        return [r[0] for r in rows]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"suffix": "!"}, "suffix"),
        ({"prompt": ["one", "two"]}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"echo": True, "logprobs": 2}, "echo"),
        ({"logprobs": 21}, "logprobs"),
        ({"messages": [{"role": "user", "content": "x"}]}, "messages"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 10**9}, "n"),
        ({"prompt": "word " * 3000}, "prompt"),  # over the 2,048-token context, counted here
    ],
)
def test_what_cannot_run_is_a_400_naming_the_field_and_nothing_is_stored(
    client: FlaskClient, tenant: tuple[str, str], services, body: dict[str, Any], param: str
) -> None:
    name, key = tenant
    r = completion(client, key, **body)
    assert r.status_code == 400, r.get_json()
    error = r.get_json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert job_kinds(services, name) == []


def test_unknown_model_is_a_404(client: FlaskClient, tenant: tuple[str, str]) -> None:
    r = completion(client, tenant[1], model="nope")
    assert r.status_code == 404 and r.get_json()["error"]["param"] == "model"


def test_a_completion_is_queued_as_a_completion_job(
    client: FlaskClient, tenant: tuple[str, str], services
) -> None:
    name, key = tenant
    r = completion(client, key, max_tokens=3)
    # No worker serves `api-only`: the sync wait ends with the job, which the client can poll.
    assert r.status_code == 202
    job = r.get_json()
    assert job["object"] == "job" and job["status"] == "queued"
    assert job_kinds(services, name) == ["completion"]
    assert client.get(f"/v2/jobs/{job['id']}", headers=auth(key)).get_json()["id"] == job["id"]
    cancelled = client.post(f"/v2/jobs/{job['id']}/cancel", headers=auth(key)).get_json()
    assert cancelled["status"] == "cancelled"


# --- HTTP Basic ------------------------------------------------------------------------


def test_basic_auth_with_the_key_as_user_name_works_like_bearer(
    client: FlaskClient, tenant: tuple[str, str]
) -> None:
    _, key = tenant
    assert client.get("/v1/models", headers=basic(key)).status_code == 200
    assert client.get("/v1/models", headers=basic(key, "ignored")).status_code == 200
    assert client.get("/v1/files", headers=basic(key)).status_code == 200


@pytest.mark.parametrize(
    "header",
    [
        "Basic !!!not-base64!!!",
        "Basic " + base64.b64encode(b"no-colon").decode(),
        "Basic " + base64.b64encode(b"\xff\xfe:").decode(),
        "Basic " + base64.b64encode(b"sk-wrong:").decode(),
        "Basic " + base64.b64encode(b":").decode(),
        "Basic",
    ],
)
def test_a_bad_basic_header_is_the_same_401(client: FlaskClient, header: str) -> None:
    for path in ("/v1/models", "/v1/completions", "/v1/llm/completions-sync?model_endpoint_name=api-only"):
        method = client.get if path == "/v1/models" else client.post
        r = method(path, headers={"Authorization": header}, json={})
        assert r.status_code == 401, (path, r.get_json())
        error = r.get_json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"


# --- batches of /v1/completions lines ---------------------------------------------------


def text_line(i: int, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": f"c-{i}",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": "api-only", "prompt": f"Once upon a time {i}", "max_tokens": 4, **body},
    }


def test_a_batch_of_completion_lines_makes_completion_jobs(
    client: FlaskClient, tenant: tuple[str, str], services
) -> None:
    name, key = tenant
    r = upload(client, key, jsonl([text_line(i) for i in range(3)]))
    assert r.status_code == 200, r.get_json()
    file_id = r.get_json()["id"]
    wrong = create(client, key, file_id)  # the batch's endpoint must be the lines' url
    assert wrong.status_code == 400 and wrong.get_json()["error"]["param"] == "endpoint"
    r = create(client, key, file_id, endpoint="/v1/completions")
    assert r.status_code == 200, r.get_json()
    batch = BatchObject.model_validate(r.get_json())
    assert batch.endpoint == "/v1/completions"
    materialize(services.db, batch.id)
    assert job_kinds(services, name) == ["completion"] * 3


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"suffix": "x"}, "body.suffix"),
        ({"stream": True}, "body.stream"),
        ({"messages": []}, "body.messages"),
    ],
)
def test_a_bad_completion_line_is_named(
    client: FlaskClient, tenant: tuple[str, str], body: dict[str, Any], param: str
) -> None:
    lines = [text_line(0), text_line(1, **body)]
    r = upload(client, tenant[1], jsonl(lines))
    assert r.status_code == 400
    assert r.get_json()["errors"]["data"][0]["param"] == param
    assert r.get_json()["errors"]["data"][0]["line"] == 2


def test_a_chat_body_under_the_completions_url_is_refused(
    client: FlaskClient, tenant: tuple[str, str]
) -> None:
    chat = {"model": "api-only", "messages": [{"role": "user", "content": "x"}]}
    r = upload(
        client,
        tenant[1],
        jsonl([{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": chat}]),
    )
    assert r.status_code == 400
    assert r.get_json()["errors"]["data"][0]["param"] in {"body.messages", "body.prompt"}


# --- Scale v1 ---------------------------------------------------------------------------


def scale_body(**fields: Any) -> dict[str, Any]:
    # What the client's CompletionSyncV1Request(...).dict() sends: every field, nulls included.
    body: dict[str, Any] = {
        "prompt": "hi",
        "max_new_tokens": 3,
        "temperature": 0.2,
        "stop_sequences": None,
        "return_token_log_probs": False,
        "presence_penalty": None,
        "frequency_penalty": None,
        "top_k": None,
        "top_p": None,
        "include_stop_str_in_output": None,
        "guided_json": None,
        "guided_regex": None,
        "guided_choice": None,
        "guided_grammar": None,
        "skip_special_tokens": True,
    }
    return {**body, **fields}


@pytest.mark.parametrize(
    ("query", "body", "status", "param"),
    [
        ("", scale_body(), 400, "model_endpoint_name"),
        ("?model_endpoint_name=nope", scale_body(), 404, "model_endpoint_name"),
        ("?model_endpoint_name=api-only", scale_body(temperature=1.5), 400, "temperature"),
        ("?model_endpoint_name=api-only", scale_body(max_new_tokens=10**9), 400, "max_new_tokens"),
        ("?model_endpoint_name=api-only", scale_body(stop_sequences=["x"] * 100), 400, "stop_sequences"),
        ("?model_endpoint_name=api-only", scale_body(prompt="word " * 3000), 400, "prompt"),
        ("?model_endpoint_name=api-only", scale_body(extra=1), 400, "extra"),
    ],
)
@pytest.mark.parametrize("route", ["completions-sync", "completions-stream"])
def test_scale_requests_that_cannot_run_name_the_scale_field(
    client: FlaskClient,
    tenant: tuple[str, str],
    services,
    route: str,
    query: str,
    body: dict[str, Any],
    status: int,
    param: str,
) -> None:
    name, key = tenant
    r = client.post(f"/v1/llm/{route}{query}", json=body, headers=basic(key))
    assert r.status_code == status, r.get_json()
    assert r.get_json()["error"]["param"] == param
    assert job_kinds(services, name) == []


def test_a_scale_request_is_a_completion_job(client: FlaskClient, tenant: tuple[str, str], services) -> None:
    name, key = tenant
    r = client.post(
        "/v1/llm/completions-sync?model_endpoint_name=api-only",
        json=scale_body(stop_sequences=["\n"], return_token_log_probs=True, top_k=-1),
        headers=basic(key),
    )
    assert r.status_code == 202  # nothing serves `api-only`: the job, still queued
    job = client.get(f"/v2/jobs/{r.get_json()['id']}", headers=auth(key)).get_json()
    assert job_kinds(services, name) == ["completion"]
    with services.db.session() as s:
        stored = s.execute(text("SELECT request FROM jobs WHERE id = :j"), {"j": job["id"]}).scalar()
    assert (
        stored
        == {
            "model": "api-only",
            "prompt": "hi",
            "max_tokens": 3,
            "temperature": 0.2,
            "stop": ["\n"],
            "logprobs": 0,
            "top_k": -1,
            "skip_special_tokens": True,
            "priority": 0,
        }
        or stored.get("max_tokens") == 3
    )
