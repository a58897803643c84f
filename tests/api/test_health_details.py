"""Worker names hold host names and pids: /readyz and /metrics show them only as
`LLMQ_HEALTH_DETAILS` says (default: to callers with a valid key). Readiness itself and the
live workers per model are always public."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import pytest
from flask.testing import FlaskClient

from app.api import create_app
from app.container import build_services
from app.services.health import register_worker, unregister_worker
from tests.helpers import Stores, auth, make_settings

HOST = f"secret-host-{secrets.token_hex(3)}"
NAME = f"llmq-4242@{HOST}"


@pytest.fixture
def worker(services) -> Iterator[None]:  # type: ignore[no-untyped-def]
    info = {
        "name": NAME,
        "model": "api-only",
        "consuming": True,
        "engine": "ok",
        "inflight": 3,
        "capacity": 8,
    }
    register_worker(services.redis, NAME, info, ttl_seconds=60)
    yield
    unregister_worker(services.redis, NAME)


def client_for(stores: Stores, mode: str) -> tuple[FlaskClient, str]:
    settings = make_settings(stores, health_details=mode)
    services = build_services(settings)
    key = services.keys.create_key(f"tenant-health-{secrets.token_hex(3)}")
    return create_app(services=services).test_client(), key


def shows_worker(client: FlaskClient, headers: dict[str, str]) -> tuple[bool, bool]:
    ready = client.get("/readyz", headers=headers)
    assert ready.status_code == 200
    workers = ready.get_json()["checks"]["workers"]
    assert workers["ok"] is True and workers["per_model"]["api-only"] >= 1  # always public
    metrics = client.get("/metrics", headers=headers).get_data(as_text=True)
    return HOST in ready.get_data(as_text=True), HOST in metrics


def test_default_shows_worker_names_only_to_a_valid_key(worker, client: FlaskClient, tenant_keys) -> None:  # type: ignore[no-untyped-def]
    assert shows_worker(client, {}) == (False, False)
    assert shows_worker(client, auth("llmq-not-a-key")) == (False, False)
    assert shows_worker(client, auth(tenant_keys["a"])) == (True, True)
    text = client.get("/metrics").get_data(as_text=True)
    assert 'llmq_model_inflight{model="api-only"}' in text and "llmq_worker_inflight" not in text
    assert "4242" not in client.get("/readyz").get_data(as_text=True)  # the pid


@pytest.mark.parametrize(("mode", "anonymous", "with_key"), [("public", True, True), ("none", False, False)])
def test_the_setting_decides(worker, stores: Stores, mode: str, anonymous: bool, with_key: bool) -> None:  # type: ignore[no-untyped-def]
    client, key = client_for(stores, mode)
    assert shows_worker(client, {}) == (anonymous, anonymous)
    assert shows_worker(client, auth(key)) == (with_key, with_key)
