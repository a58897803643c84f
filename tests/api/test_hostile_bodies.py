"""Bodies that parse but cannot be carried on — a lone surrogate, a 5,000-digit integer,
NaN, a NUL in a batch `custom_id` — are 400s naming the field (or the line) on every route
that takes JSON, never 500s and never queued jobs that fail later."""

from __future__ import annotations

import io
import json
import secrets
from collections.abc import Iterator

import pytest
from flask.testing import FlaskClient

from app.api import create_app
from app.container import build_services
from tests.helpers import Stores, auth, make_settings

ROUTES = ["/v2/jobs", "/v1/chat/completions", "/v2/chat/completions", "/bench/chat/completions"]
PREFIX = '{"model": "api-only", "max_tokens": 4, '

BODIES = {
    # JSON's own escape for half a UTF-16 pair: json.loads yields a str no encoder accepts.
    "lone_surrogate": (
        PREFIX + '"messages": [{"role": "user", "content": "a\\ud800b"}]}',
        "messages[0].content",
    ),
    "surrogate_in_part": (
        PREFIX + '"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}',
        "messages[0].content[0].text",
    ),
    "huge_integer": (
        PREFIX + '"messages": [{"role": "user", "content": "hi"}], "seed": ' + "9" * 5000 + "}",
        "seed",
    ),
    "huge_integer_in_free_json": (
        PREFIX
        + '"messages": [{"role": "user", "content": "hi"}], "guided_json": {"type": "integer", "maximum": '
        + "9" * 5000
        + "}}",
        "guided_json.maximum",
    ),
    "nan": (
        PREFIX + '"messages": [{"role": "user", "content": "hi"}], "guided_json": {"maximum": NaN}}',
        "guided_json.maximum",
    ),
}


@pytest.fixture(scope="module")
def quick(stores: Stores) -> Iterator[tuple[FlaskClient, str]]:
    # Sync routes answer 202 after a short wait instead of waiting for a worker, so a body
    # that is wrongly accepted shows as a 202 rather than a stalled test.
    settings = make_settings(stores, sync_wait_seconds=0.05)
    services = build_services(settings)
    key = services.keys.create_key(f"tenant-hostile-{secrets.token_hex(3)}")
    yield create_app(services=services).test_client(), key
    services.close()


def assert_400(response, param: str | None) -> dict:  # type: ignore[no-untyped-def]
    assert response.status_code == 400, response.get_data(as_text=True)[:300]
    error = response.get_json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    return error


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("case", sorted(BODIES))
def test_unusable_values_are_400_naming_the_field(quick, route: str, case: str) -> None:
    client, key = quick
    raw, param = BODIES[case]
    r = client.post(route, data=raw.encode(), headers={**auth(key), "Content-Type": "application/json"})
    assert_400(r, param)


def test_batch_create_refuses_a_surrogate_in_metadata(quick) -> None:
    client, key = quick
    raw = '{"input_file_id": "file_x", "endpoint": "/v1/chat/completions", "completion_window": "24h", '
    raw += '"metadata": {"note": "\\ud800"}}'
    r = client.post(
        "/v1/batches", data=raw.encode(), headers={**auth(key), "Content-Type": "application/json"}
    )
    assert_400(r, "metadata.note")


def batch_line(custom_id: str, content: str = "hi") -> str:
    body = {"model": "api-only", "messages": [{"role": "user", "content": content}]}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body})


def upload(client: FlaskClient, key: str, data: bytes, name: str = "in.jsonl"):  # type: ignore[no-untyped-def]
    return client.post(
        "/v1/files",
        data={"purpose": "batch", "file": (io.BytesIO(data), name)},
        headers=auth(key),
        content_type="multipart/form-data",
    )


def test_nul_in_custom_id_is_a_line_error(quick) -> None:
    client, key = quick
    data = (batch_line("ok") + "\n" + batch_line("a\x00b") + "\n").encode()
    r = upload(client, key, data)
    error = assert_400(r, "custom_id")
    assert r.get_json()["errors"]["data"] == [
        {
            "code": "invalid_custom_id",
            "message": error["message"].removeprefix("line 2: "),
            "param": "custom_id",
            "line": 2,
        }
    ]


@pytest.mark.parametrize(
    ("line", "param", "reason"),
    [
        (batch_line("s", "\ud800"), "body.messages[0].content", "surrogate"),
        (batch_line("n")[:-2] + ', "seed": ' + "9" * 5000 + "}}", "body.seed", "5000 digits"),
        # jiter parses these; Postgres's json cast at batch creation did not (a 500 there).
        (batch_line("n")[:-2] + ', "guided_json": {"maximum": NaN}}}', "body.guided_json.maximum", "NaN"),
        (
            batch_line("n")[:-2] + ', "guided_json": {"enum": [-Infinity]}}}',
            "body.guided_json.enum[0]",
            "Infinity",
        ),
    ],
)
def test_unparseable_line_names_line_field_and_reason(quick, line: str, param: str, reason: str) -> None:
    client, key = quick
    r = upload(client, key, (batch_line("first") + "\n" + line + "\n").encode())
    assert_400(r, param)
    (only,) = r.get_json()["errors"]["data"]
    assert (only["line"], only["param"], only["code"]) == (2, param, "invalid_json")
    assert reason in only["message"]


def test_nan_text_in_a_line_is_fine(quick) -> None:
    client, key = quick
    r = upload(client, key, (batch_line("t", "NaN and Infinity are words") + "\n").encode())
    assert r.status_code == 200, r.get_data(as_text=True)


def test_nul_in_file_name_is_400(quick) -> None:
    client, key = quick
    assert_400(upload(client, key, (batch_line("x") + "\n").encode(), name="a\x00b.jsonl"), "file")


@pytest.mark.parametrize("host", ["0x7f000001", "2130706433", "127.1", "0177.0.0.1", "[::ffff:127.0.0.1]"])
@pytest.mark.parametrize("route", ROUTES)
def test_non_canonical_loopback_image_urls_are_400(quick, route: str, host: str) -> None:
    client, key = quick
    content = [
        {"type": "text", "text": "look"},
        {"type": "image_url", "image_url": {"url": f"http://{host}/a.png"}},
    ]
    body = {"model": "api-only", "max_tokens": 4, "messages": [{"role": "user", "content": content}]}
    error = assert_400(
        client.post(route, json=body, headers=auth(key)), "messages[0].content[1].image_url.url"
    )
    assert "not allowed" in error["message"]
