"""Two models behind one API: what workers register is what /v1/models, the request checks,
readiness and metrics see; a model neither declared nor live is a 404 naming `model`; each
model's jobs go to its own queue."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from flask.testing import FlaskClient

from app.api import create_app
from app.container import Services, build_services
from app.modelkit.tiny import build_tiny
from app.queue import queue_name
from app.services.health import live_workers, register_worker, unregister_worker
from tests.helpers import TINY_DIR, Stores, auth, jsonl, line, make_settings, upload

WORKERS = {
    "w-a1": {"model": "model-a", "max_model_len": 4096, "capacity": 8, "consuming": True},
    "w-a2": {"model": "model-a", "max_model_len": 4096, "capacity": 8, "consuming": True},
    "w-b": {"model": "model-b", "max_model_len": 64, "capacity": 4, "consuming": True},
}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding the tiny model's tokenizer (only what counting needs)."""
    folder = tmp_path_factory.mktemp("tok")
    if not (TINY_DIR / "tokenizer.json").is_file():
        build_tiny(TINY_DIR)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json"):
        if (TINY_DIR / name).is_file():
            shutil.copy(TINY_DIR / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def fleet(stores: Stores, tokenizer_dir: Path) -> Iterator[tuple[Services, FlaskClient, str]]:
    """An API with no model of its own, `declared-c` declared, and three registered workers:
    two of model-a (no tokenizer reachable: counted by the worker), one of model-b (its
    tokenizer folder is readable here, its context tiny)."""
    services = build_services(
        make_settings(
            stores, model=None, served_model_name=None, models="declared-c", model_registry_ttl_seconds=0
        )
    )
    for name, info in WORKERS.items():
        tokenizer = str(tokenizer_dir) if info["model"] == "model-b" else "/models/not-on-this-machine"
        register_worker(services.redis, name, {"name": name, "tokenizer": tokenizer, **info}, 60)
    try:
        yield services, create_app(services=services).test_client(), services.keys.create_key("tenant-models")
    finally:
        for name in WORKERS:
            unregister_worker(services.redis, name)
        services.close()


def chat(model: str, content: str = "hi", **fields: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}], **fields}


def test_models_lists_live_and_declared_models(fleet: tuple[Services, FlaskClient, str]) -> None:
    _, client, key = fleet
    r = client.get("/v1/models", headers=auth(key))
    assert r.status_code == 200
    cards = {c["id"]: c for c in r.get_json()["data"]}
    assert sorted(cards) == ["declared-c", "model-a", "model-b"]
    assert {k: cards["model-a"][k] for k in ("object", "live", "workers", "max_model_len", "declared")} == {
        "object": "model",
        "live": True,
        "workers": 2,
        "max_model_len": 4096,
        "declared": False,
    }
    assert (cards["model-b"]["live"], cards["model-b"]["max_model_len"]) == (True, 64)
    assert (cards["declared-c"]["live"], cards["declared-c"]["declared"]) == (False, True)
    assert cards["declared-c"]["max_model_len"] is None


def test_an_unknown_model_is_a_404_naming_model(fleet: tuple[Services, FlaskClient, str]) -> None:
    _, client, key = fleet
    for path in ("/v2/jobs", "/v1/chat/completions"):
        r = client.post(path, json=chat("model-z"), headers=auth(key))
        assert r.status_code == 404, (path, r.get_json())
        error = r.get_json()["error"]
        assert (error["param"], error["code"], error["type"]) == (
            "model",
            "model_not_found",
            "not_found_error",
        )
        assert "model-a" in error["message"] and "declared-c" in error["message"]
    r = upload(client, key, jsonl([line(1, model="model-z")]))
    assert r.status_code == 400
    assert r.get_json()["error"]["code"] == "invalid_file"
    assert "model_not_found" in json.dumps(r.get_json())


def test_each_models_jobs_go_to_its_own_queue(fleet: tuple[Services, FlaskClient, str]) -> None:
    services, client, key = fleet
    before = {m: services.liveness.depth(m) for m in ("model-a", "model-b", "declared-c")}
    sent = {"model-b": 2, "declared-c": 1}
    for model, n in sent.items():
        for _ in range(n):
            r = client.post("/v2/jobs", json=chat(model, max_tokens=2), headers=auth(key))
            assert r.status_code == 202, r.get_json()
    after = {m: services.liveness.depth(m) for m in before}
    assert {m: after[m] - before[m] for m in before} == {"model-a": 0, "model-b": 2, "declared-c": 1}
    assert queue_name("model-b") != queue_name("model-a")


def test_queue_names_of_two_models_never_collide() -> None:
    assert queue_name("org/model") != queue_name("org_model")
    assert queue_name("api-only") == "llmq.api-only"  # a plain name keeps its queue


def test_prompt_length_is_checked_where_the_tokenizer_is_reachable(
    fleet: tuple[Services, FlaskClient, str],
) -> None:
    services, client, key = fleet
    long = "word " * 200  # far over model-b's 64 tokens
    r = client.post("/v2/jobs", json=chat("model-b", long), headers=auth(key))
    assert r.status_code == 400
    assert r.get_json()["error"]["code"] == "context_length_exceeded"
    # model-a's tokenizer is not on this machine: the job is queued, the worker checks it.
    r = client.post("/v2/jobs", json=chat("model-a", long * 30, max_tokens=2), headers=auth(key))
    assert r.status_code == 202
    assert services.tokenizers is not None and len(services.tokenizers.loaded()) == 1


def test_readiness_and_metrics_count_the_registered_models(fleet: tuple[Services, FlaskClient, str]) -> None:
    _, client, key = fleet
    per_model = client.get("/readyz").get_json()["checks"]["workers"]["per_model"]
    assert {m: per_model.get(m) for m in ("model-a", "model-b", "declared-c")} == {
        "model-a": 2,
        "model-b": 1,
        "declared-c": 0,
    }
    metrics = client.get("/metrics", headers=auth(key)).get_data(as_text=True)
    assert 'llmq_queue_depth{model="declared-c"}' in metrics
    assert 'llmq_queue_depth{model="model-a"}' in metrics
    assert 'llmq_workers_consuming{model="model-a"} 2' in metrics


def test_a_worker_that_goes_takes_its_model_with_it(stores: Stores) -> None:
    services = build_services(
        make_settings(stores, model=None, served_model_name=None, model_registry_ttl_seconds=0)
    )
    try:
        client, key = create_app(services=services).test_client(), services.keys.create_key("tenant-gone")
        register_worker(services.redis, "w-brief", {"name": "w-brief", "model": "brief", "capacity": 2}, 60)
        assert client.post("/v2/jobs", json=chat("brief", max_tokens=1), headers=auth(key)).status_code == 202
        unregister_worker(services.redis, "w-brief")
        assert not any(w.get("name") == "w-brief" for w in live_workers(services.redis))
        assert client.post("/v2/jobs", json=chat("brief"), headers=auth(key)).status_code == 404
    finally:
        unregister_worker(services.redis, "w-brief")
        services.close()


def test_registry_entries_lapse_with_their_ttl(stores: Stores, services: Services) -> None:
    register_worker(services.redis, "w-lapse", {"name": "w-lapse", "model": "lapse"}, 1)
    assert any(w.get("name") == "w-lapse" for w in live_workers(services.redis))
    time.sleep(1.2)
    assert not any(w.get("name") == "w-lapse" for w in live_workers(services.redis))
