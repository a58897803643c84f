"""Structured outputs at the API (issue 9 items 1 and 7): constraints that crash the
structured-output library are 400s before anything is queued, fast, and the API process
lives on; invalid regexes and out-of-vocabulary token ids are 400s at submit."""

from __future__ import annotations

import io
import json
import os
import secrets
import time
from collections.abc import Iterator

import pytest
from flask import Flask
from flask.testing import FlaskClient

from app.api import create_app
from app.container import build_services
from tests.bombs import chained_grammar, ref_chain_schema
from tests.helpers import ROOT, Stores, auth, make_settings


def body(model: str = "api-only", **fields) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}


def schema_format(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "bomb", "schema": schema}}


BOMBS = [
    ({"response_format": schema_format(ref_chain_schema())}, "response_format.json_schema.schema"),
    ({"guided_grammar": chained_grammar()}, "guided_grammar"),
]


def assert_400(response, param: str) -> dict:
    assert response.status_code == 400, response.get_data(as_text=True)
    error = response.get_json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    return error


@pytest.mark.parametrize(("fields", "param"), BOMBS)
def test_bombs_are_400s_at_submit_by_the_bounds(client: FlaskClient, tenant_keys, fields, param) -> None:
    for path in ["/v2/jobs", "/v1/chat/completions"]:
        started = time.monotonic()
        r = client.post(path, json=body(**fields), headers=auth(tenant_keys["a"]))
        assert_400(r, param)
        assert time.monotonic() - started < 2


@pytest.fixture(scope="module")
def roomy(stores: Stores) -> Iterator[tuple[FlaskClient, str]]:
    """An API whose bounds let the bombs through to the sandbox compile, and that knows the
    tiny model's vocabulary (a local model folder); with a key of its own."""
    settings = make_settings(
        stores,
        model=str(ROOT / ".test-models" / "tiny"),
        served_model_name="api-only",
        max_schema_bytes=1 << 20,
        max_schema_refs=10_000,
        max_schema_ref_depth=10_000,
        max_grammar_rules=100_000,
    )
    services = build_services(settings)
    app: Flask = create_app(services=services)
    yield app.test_client(), services.keys.create_key(f"tenant-structured-{secrets.token_hex(3)}")
    services.close()


@pytest.mark.parametrize(("fields", "param"), BOMBS)
def test_a_bomb_past_the_bounds_is_a_400_from_the_sandbox_and_the_api_lives(
    roomy: tuple[FlaskClient, str], fields, param
) -> None:
    client, key = roomy
    pid = os.getpid()
    started = time.monotonic()
    r = client.post("/v2/jobs", json=body(**fields), headers=auth(key))
    error = assert_400(r, param)
    assert "crashed" in error["message"]
    assert time.monotonic() - started < 10
    assert os.getpid() == pid
    # The same API answers the next tenant's request.
    ok = client.post("/v2/jobs", json=body(guided_regex=r"\d{4}"), headers=auth(key))
    assert ok.status_code == 202, ok.get_json()


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"guided_regex": "a(b"}, "guided_regex"),
        ({"guided_json": {"type": "string", "pattern": "([0-9]"}}, "guided_json"),
        (
            {"response_format": schema_format({"type": "object", "properties": {"d": {"pattern": "[0-9"}}})},
            "response_format.json_schema.schema",
        ),
        ({"logit_bias": {"1024": 3}}, "logit_bias"),
        ({"stop_token_ids": [7, 5000]}, "stop_token_ids"),
    ],
)
def test_invalid_regex_and_out_of_vocabulary_ids_are_400s_at_submit(
    roomy: tuple[FlaskClient, str], fields, param
) -> None:
    client, key = roomy
    assert_400(client.post("/v2/jobs", json=body(**fields), headers=auth(key)), param)


def test_in_vocabulary_ids_are_accepted(roomy: tuple[FlaskClient, str]) -> None:
    client, key = roomy
    r = client.post("/v2/jobs", json=body(logit_bias={"1023": 3}, stop_token_ids=[0]), headers=auth(key))
    assert r.status_code == 202, r.get_json()


def test_a_batch_line_with_a_bomb_is_refused_at_upload(roomy: tuple[FlaskClient, str]) -> None:
    client, key = roomy
    lines = [
        {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body()}
        for i in range(3)
    ]
    lines[1]["body"]["guided_grammar"] = chained_grammar()
    data = b"".join(json.dumps(x).encode() + b"\n" for x in lines)
    r = client.post(
        "/v1/files",
        data={"purpose": "batch", "file": (io.BytesIO(data), "input.jsonl")},
        headers=auth(key),
        content_type="multipart/form-data",
    )
    assert r.status_code == 400, r.get_json()
    (err,) = r.get_json()["errors"]["data"]
    assert err["line"] == 2 and err["param"] == "body.guided_grammar"
