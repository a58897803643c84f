"""What a client sees must be what is true: the model's context length on /v1/models,
and a 400 for `stream_options` without a stream, as OpenAI answers."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from flask.testing import FlaskClient

from app.api import create_app
from app.container import build_services
from tests.helpers import Stores, auth, make_settings


@pytest.mark.parametrize("configured", [None, 1024])
def test_models_say_the_context_length(stores: Stores, tmp_path: Path, configured: int | None) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"max_position_embeddings": 3072}))
    settings = make_settings(
        stores,
        model=str(folder),
        served_model_name="api-only",
        max_model_len=configured,
        api_counts_prompt_tokens=False,
    )
    services = build_services(settings)
    try:
        client = create_app(services=services).test_client()
        key = services.keys.create_key("tenant-models")
        cards = client.get("/v1/models", headers=auth(key)).get_json()["data"]
    finally:
        services.close()
    assert [(c["id"], c["max_model_len"]) for c in cards] == [("api-only", configured or 3072)]


@pytest.fixture(scope="module")
def quick(stores: Stores) -> Iterator[tuple[FlaskClient, str]]:
    """A short sync wait: were the request queued, it answers 202 at once instead of
    waiting minutes for a worker that is not there."""
    services = build_services(make_settings(stores, sync_wait_seconds=0.05))
    yield create_app(services=services).test_client(), services.keys.create_key("tenant-stream-options")
    services.close()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v2/chat/completions", "/bench/chat/completions"])
@pytest.mark.parametrize("stream", [None, False])
def test_stream_options_without_stream_is_refused(
    quick: tuple[FlaskClient, str], path: str, stream: bool | None
) -> None:
    client, key = quick
    body = {
        "model": "api-only",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "stream_options": {"include_usage": True},
    }
    if stream is not None:
        body["stream"] = stream
    before = client.get("/v2/jobs?limit=100", headers=auth(key)).get_json()["data"]
    r = client.post(path, json=body, headers=auth(key))
    assert r.status_code == 400
    assert r.get_json()["error"]["param"] == "stream_options"
    after = client.get("/v2/jobs?limit=100", headers=auth(key)).get_json()["data"]
    assert [j["id"] for j in after] == [j["id"] for j in before]  # nothing was queued
