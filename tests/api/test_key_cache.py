"""An API process's key cache against real Postgres and Redis: a key seen lately is
answered without Postgres, revoking it or changing its tenant's band through llmq is seen
by the next request, and a change made in Postgres by hand within the cache time."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from typing import Any

import pytest
from flask import Flask
from flask.testing import FlaskClient
from redis import exceptions as redis_errors
from sqlalchemy import text

from app.api import create_app
from app.container import Services, build_services
from app.services.keys import KeyCache, KeyService, Principal
from tests.api.test_jobs_api import assert_error
from tests.helpers import Stores, auth, make_settings


@pytest.fixture(scope="module")
def cached(stores: Stores) -> Iterator[Services]:
    svc = build_services(make_settings(stores, auth_cache_seconds=1.0))
    yield svc
    svc.close()


@pytest.fixture
def client(cached: Services) -> FlaskClient:
    app: Flask = create_app(services=cached)
    return app.test_client()


@pytest.fixture
def lookups(cached: Services, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Each time a key is looked up in Postgres."""
    seen: list[str] = []
    original = KeyService.authenticate

    def counting(self: KeyService, key: str | None) -> Principal:
        seen.append(key or "")
        return original(self, key)

    monkeypatch.setattr(KeyService, "authenticate", counting)
    return seen


def new_key(services: Services) -> tuple[str, str]:
    tenant = f"tenant-cache-{secrets.token_hex(3)}"
    key = services.keys.create_key(tenant)
    return tenant, key


def test_a_key_seen_lately_is_not_looked_up_again(
    client: FlaskClient, cached: Services, lookups: list[str]
) -> None:
    _, key = new_key(cached)
    for _ in range(5):
        assert client.get("/v2/jobs", headers=auth(key)).status_code == 200
    assert lookups == [key]


def test_revoking_through_llmq_is_seen_by_the_next_request(
    client: FlaskClient, cached: Services, lookups: list[str]
) -> None:
    tenant, key = new_key(cached)
    assert client.get("/v2/jobs", headers=auth(key)).status_code == 200
    assert client.get("/v2/jobs", headers=auth(key)).status_code == 200
    # Another process's KeyService (the CLI's): Postgres and the Redis generation only.
    other = KeyService(cached.db, redis=cached.redis)
    other.revoke(other.list_keys(tenant)[0].id)
    assert_error(client.get("/v2/jobs", headers=auth(key)), 401)
    assert_error(client.get("/v2/jobs", headers=auth(key)), 401)
    assert lookups == [key, key, key]  # revoked keys are never kept


def test_a_band_change_is_seen_by_the_next_request(client: FlaskClient, cached: Services) -> None:
    tenant, key = new_key(cached)
    body: dict[str, Any] = {
        "model": "api-only",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "priority": 5,
    }
    assert client.post("/v2/jobs", json=body, headers=auth(key)).status_code == 202
    KeyService(cached.db, redis=cached.redis).set_priority_band(tenant, 0, 3)
    assert_error(client.post("/v2/jobs", json=body, headers=auth(key)), 400, param="priority")


def test_a_change_made_by_hand_is_seen_within_the_cache_time(client: FlaskClient, cached: Services) -> None:
    tenant, key = new_key(cached)
    assert client.get("/v2/jobs", headers=auth(key)).status_code == 200
    with cached.db.session() as s:  # no generation bump: only the cache time bounds it
        s.execute(text("UPDATE api_keys SET revoked_at = now() WHERE tenant_id = :t"), {"t": tenant})
    time.sleep(1.1)
    assert_error(client.get("/v2/jobs", headers=auth(key)), 401)


def test_cache_keeps_at_most_its_size_and_forgets_after_its_time() -> None:
    cache = KeyCache(0.2, size=2)
    for name in ("a", "b", "c"):
        cache.put(name, Principal(tenant_id=name, key_id=name), 0)
    assert cache.get("a") is None
    assert cache.get("b") is not None and cache.get("c") is not None
    time.sleep(0.25)
    assert cache.get("b") is None


def test_the_cli_revokes_through_redis_or_says_when_it_applies(
    client: FlaskClient,
    cached: Services,
    stores: Stores,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from app.cli.main import main as cli

    monkeypatch.setenv("LLMQ_DATABASE_URL", stores.database_url)
    monkeypatch.delenv("LLMQ_REDIS_URL", raising=False)
    tenant, key = new_key(cached)
    assert client.get("/v2/jobs", headers=auth(key)).status_code == 200
    assert cli(["keys", "revoke", cached.keys.list_keys(tenant)[0].id]) == 0
    assert "LLMQ_REDIS_URL is not set" in capsys.readouterr().err
    assert client.get("/v2/jobs", headers=auth(key)).status_code == 200  # nobody told this process

    monkeypatch.setenv("LLMQ_REDIS_URL", stores.redis_url)
    tenant, key = new_key(cached)
    assert client.get("/v2/jobs", headers=auth(key)).status_code == 200
    assert cli(["keys", "revoke", cached.keys.list_keys(tenant)[0].id]) == 0
    assert "LLMQ_REDIS_URL is not set" not in capsys.readouterr().err
    assert_error(client.get("/v2/jobs", headers=auth(key)), 401)


def test_with_redis_down_keys_are_looked_up_in_postgres(cached: Services) -> None:
    """With the rate limit off, an API needed no Redis to authenticate before the cache:
    it still needs none (a submit while Redis is down is accepted: R6)."""
    from app.connections import quick_redis_client
    from app.services.limits import RateLimiter

    down = quick_redis_client("redis://127.0.0.1:1/0")
    cache = KeyCache(10.0)
    keys = KeyService(cached.db, redis=down, cache=cache)
    no_limit = RateLimiter(down, per_minute=0, burst=1)
    _, key = new_key(cached)
    first = keys.admit(key, no_limit)
    assert keys.admit(key, no_limit) == first
    # An entry kept while Redis was up is checked against Postgres while it is down.
    up = KeyService(cached.db, redis=cached.redis, cache=cache)
    assert up.admit(key, RateLimiter(cached.redis, per_minute=0, burst=1)) == first
    assert keys.admit(key, no_limit) == first
    # With the rate limit on, Redis is needed, as it was without the cache.
    with pytest.raises(redis_errors.ConnectionError):
        keys.admit(key, RateLimiter(down, per_minute=60, burst=10))
    keys.close()


def test_requests_arriving_together_with_a_new_key_make_one_lookup(cached: Services) -> None:
    """A burst with a key no process has cached (60 downloads at once) waits for one
    Postgres lookup, not one each, every one of which waits for the pool."""
    import threading

    from sqlalchemy.exc import TimeoutError as PoolTimeout

    from app.services.keys import AUTH_GENERATION
    from app.services.limits import RateLimiter

    seen: list[str] = []
    release = threading.Event()
    pool_full = threading.Event()

    class Slow(KeyService):
        def authenticate(self, key: str | None) -> Principal:
            seen.append(key or "")
            release.wait(5)  # the other requests arrive while this lookup runs
            if pool_full.is_set():
                raise PoolTimeout("QueuePool limit of size 2 overflow 0 reached")
            return super().authenticate(key)

    keys = Slow(cached.db, redis=cached.redis, cache=KeyCache(10.0))
    limiter = RateLimiter(cached.redis, per_minute=0, burst=1)
    answers: list[Principal] = []
    failures: list[str] = []

    def admit(key: str) -> None:
        try:
            answers.append(keys.admit(key, limiter))
        except Exception as exc:  # the test collects what each request got
            failures.append(type(exc).__name__)

    def burst(key: str, count: int, *, meanwhile: Any = None) -> None:
        seen.clear()
        answers.clear()
        failures.clear()
        release.clear()
        threads = [threading.Thread(target=admit, args=(key,)) for _ in range(count)]
        threads[0].start()
        time.sleep(0.2)  # the first one leads the lookup
        if meanwhile is not None:
            meanwhile()
        for t in threads[1:]:
            t.start()
        time.sleep(0.3)
        release.set()
        for t in threads:
            t.join(10)

    _, key = new_key(cached)
    burst(key, 20)
    assert len(answers) == 20 and len(set(answers)) == 1
    assert len(seen) == 1

    # A key changed while a lookup ran (a revocation commits, then bumps the generation):
    # requests that read the new generation do not take the older lookup's answer.
    _, key = new_key(cached)
    burst(key, 5, meanwhile=lambda: cached.redis.incr(AUTH_GENERATION))
    assert len(answers) == 5
    assert len(seen) == 5

    # An unknown key is never kept or shared (it may have been created since the lookup
    # began): each request looks it up and gets its own 401.
    burst("llmq-not-a-key", 5)
    assert failures == ["Unauthorized"] * 5
    assert len(seen) == 5

    # A full pool is shared: the waiting requests fail with it at once (a 503 each), not
    # after waiting for the pool themselves.
    _, key = new_key(cached)
    pool_full.set()
    burst(key, 5)
    assert failures == ["TimeoutError"] * 5
    assert len(seen) == 1
