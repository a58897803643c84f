"""Fair use (X10): priority bands per tenant, the fair-share feeder, per-tenant caps on
single jobs (atomic under concurrency) and on unfinished batch lines."""

from __future__ import annotations

import secrets
import threading
from typing import Any

import pytest
from flask.testing import FlaskClient
from sqlalchemy import text

from app.api import create_app
from app.cli.main import main as cli
from app.container import build_services
from app.errors import RateLimited
from app.services.batch_lifecycle import BatchLifecycle
from app.services.batches import window_seconds
from tests.helpers import Stores, auth, jsonl, line, make_settings, upload


def body(**fields: Any) -> dict[str, Any]:
    return {"model": "api-only", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **fields}


@pytest.fixture
def tenant(services) -> tuple[str, str]:  # type: ignore[no-untyped-def]
    name = f"tenant-fair-{secrets.token_hex(3)}"
    return name, services.keys.create_key(name)


def make_batch(client: FlaskClient, key: str, lines: list[dict[str, Any]]):  # type: ignore[no-untyped-def]
    r = upload(client, key, jsonl(lines))
    assert r.status_code == 200, r.get_json()
    return client.post(
        "/v1/batches",
        json={
            "input_file_id": r.get_json()["id"],
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        },
        headers=auth(key),
    )


# --- priority bands -------------------------------------------------------------------------


@pytest.mark.parametrize("priority", [-(2**31), -1, 101, 2**31 - 1])
@pytest.mark.parametrize("path", ["/v2/jobs", "/v1/chat/completions"])
def test_priority_outside_the_band_is_a_400_naming_it(
    client: FlaskClient, tenant, path: str, priority: int
) -> None:
    r = client.post(path, json=body(priority=priority), headers=auth(tenant[1]))
    assert r.status_code == 400
    error = r.get_json()["error"]
    assert error["param"] == "priority" and "0..100" in error["message"]


def test_priority_inside_the_band_is_kept_and_unset_is_the_default(client: FlaskClient, tenant) -> None:
    r = client.post("/v2/jobs", json=body(priority=40), headers=auth(tenant[1]))
    assert r.status_code == 202 and r.get_json()["priority"] == 40
    r = client.post("/v2/jobs", json=body(), headers=auth(tenant[1]))
    assert r.status_code == 202 and r.get_json()["priority"] == 0


def test_operators_set_bands_with_the_cli(
    client: FlaskClient,
    tenant,
    stores: Stores,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    name, key = tenant
    # The deployment's settings, Redis included: the API's key caches are told of each change.
    monkeypatch.setenv("LLMQ_DATABASE_URL", stores.database_url)
    monkeypatch.setenv("LLMQ_REDIS_URL", stores.redis_url)
    assert cli(["tenants", "set", name, "--priority-min", "-10", "--priority-max", "20"]) == 0
    assert "-10..20" in capsys.readouterr().out
    r = client.post("/v2/jobs", json=body(priority=-10), headers=auth(key))
    assert r.status_code == 202 and r.get_json()["priority"] == -10
    assert client.post("/v2/jobs", json=body(priority=21), headers=auth(key)).status_code == 400
    # Demoted: even an unset priority runs at the band's lower end, and the worker sees it.
    assert cli(["tenants", "set", name, "--priority-min", "50", "--priority-max", "60"]) == 0
    r = client.post("/v2/jobs", json=body(), headers=auth(key))
    assert r.status_code == 202 and r.get_json()["priority"] == 50
    assert cli(["tenants", "set", name, "--priority-min", "70"]) == 1  # min above max
    assert "min <= max" in capsys.readouterr().err


def test_batch_lines_are_checked_against_the_band_at_creation(client: FlaskClient, tenant, services) -> None:
    name, key = tenant
    r = make_batch(client, key, [line(1), line(2, priority=-5)])
    assert r.status_code == 400
    error = r.get_json()["error"]
    assert error["param"] == "priority" and "line 2" in error["message"] and "0..100" in error["message"]
    services.keys.set_priority_band(name, 30, 40)
    r = make_batch(client, key, [line(1), line(2, priority=35)])
    assert r.status_code == 200
    with services.db.session() as s:
        got = dict(
            s.execute(
                text("SELECT line_no, priority FROM jobs WHERE batch_id = :b"), {"b": r.get_json()["id"]}
            ).all()
        )
    assert got == {1: 30, 2: 35}


# --- caps -----------------------------------------------------------------------------------


def test_concurrent_submits_at_the_cap_create_exactly_the_cap(stores: Stores) -> None:
    """Issue 10 defect 5: 32 submits at once against a cap of 5: five jobs, 27 429s."""
    settings = make_settings(stores, max_active_jobs_per_tenant=5, db_pool_size=32)
    services = build_services(settings)
    name = f"tenant-race-{secrets.token_hex(3)}"
    principal = services.keys.authenticate(services.keys.create_key(name))
    start = threading.Barrier(32)
    outcomes: list[str] = []

    def submit() -> None:
        start.wait()
        try:
            services.jobs.submit(principal, body())
            outcomes.append("created")
        except RateLimited:
            outcomes.append("429")

    threads = [threading.Thread(target=submit) for _ in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    with services.db.session() as s:
        stored = s.execute(text("SELECT count(*) FROM jobs WHERE tenant_id = :t"), {"t": name}).scalar()
    services.close()
    assert sorted(outcomes).count("created") == 5 and outcomes.count("429") == 27
    assert stored == 5


def test_batch_lines_have_a_per_tenant_cap(stores: Stores) -> None:
    settings = make_settings(stores, max_active_batch_lines_per_tenant=3)
    services = build_services(settings)
    client = create_app(services=services).test_client()
    key = services.keys.create_key(f"tenant-lines-{secrets.token_hex(3)}")
    assert make_batch(client, key, [line(1), line(2)]).status_code == 200
    r = make_batch(client, key, [line(1), line(2)])
    assert r.status_code == 429
    assert "only 1 of the tenant's 3" in r.get_json()["error"]["message"]
    assert make_batch(client, key, [line(1)]).status_code == 200
    services.close()


# --- the feeder -----------------------------------------------------------------------------


class RecordingQueue:
    def __init__(self) -> None:
        self.messages: list[list[str]] = []

    def enqueue_chunk(self, job_ids: list[str], model: str, priority: int) -> None:
        self.messages.append(job_ids)


def test_feeder_shares_lines_across_tenants_not_oldest_batch_first(client: FlaskClient, services) -> None:
    """Tenant A's 300-line batch is older; tenant B's one-line batch still gets its line in
    the first round, ahead of A's second line."""
    a = services.keys.create_key(f"tenant-big-{secrets.token_hex(3)}")
    b = services.keys.create_key(f"tenant-small-{secrets.token_hex(3)}")
    big = make_batch(client, a, [line(i) for i in range(300)]).get_json()["id"]
    small = make_batch(client, b, [line(1)]).get_json()["id"]
    queue = RecordingQueue()
    lifecycle = BatchLifecycle(services.db, queue, services.events, window=100_000, chunk=8)  # type: ignore[arg-type]
    lifecycle.feed()
    sent = [j for message in queue.messages for j in message]
    mine = [j for j in sent if big.removeprefix("batch_") in j or small.removeprefix("batch_") in j]
    assert len(mine) == 301
    b_line = next(i for i, j in enumerate(mine) if small.removeprefix("batch_") in j)
    assert b_line <= 1, f"tenant B's line went out {b_line}th, behind tenant A's older batch"


def test_feeder_window_follows_live_capacity(services) -> None:
    """Two live workers of 128 each: 1.5 x 256 lines out, chunks of a quarter of a worker;
    none live: the cold window; the setting only caps it."""
    lifecycle = BatchLifecycle(
        services.db, RecordingQueue(), services.events, chunk=64, capacities=lambda model: [128, 128]
    )  # type: ignore[arg-type]
    assert (lifecycle.plan("api-only").window, lifecycle.plan("api-only").chunk) == (384, 32)
    capped = BatchLifecycle(
        services.db, RecordingQueue(), services.events, chunk=64, window=100, capacities=lambda m: [128]
    )  # type: ignore[arg-type]
    assert capped.window("api-only") == 100
    idle = BatchLifecycle(
        services.db, RecordingQueue(), services.events, chunk=64, cold_window=200, capacities=lambda m: []
    )  # type: ignore[arg-type]
    assert (idle.plan("api-only").window, idle.plan("api-only").chunk) == (200, 50)


def make_windowed_batch(client: FlaskClient, key: str, n: int, window: str) -> str:
    r = upload(client, key, jsonl([line(i) for i in range(n)]))
    assert r.status_code == 200, r.get_json()
    r = client.post(
        "/v1/batches",
        json={
            "input_file_id": r.get_json()["id"],
            "endpoint": "/v1/chat/completions",
            "completion_window": window,
        },
        headers=auth(key),
    )
    assert r.status_code == 200, r.get_json()
    return str(r.get_json()["id"]).removeprefix("batch_")


def test_feeder_sends_a_tenants_earliest_deadline_first(client: FlaskClient, tenant, services) -> None:
    """The 24h batch is older; the 1h batch created after it still goes first, whole."""
    _, key = tenant
    day = make_windowed_batch(client, key, 40, "24h")
    hour = make_windowed_batch(client, key, 30, "1h")
    queue = RecordingQueue()
    lifecycle = BatchLifecycle(services.db, queue, services.events, window=100_000, chunk=8)  # type: ignore[arg-type]
    lifecycle.feed()
    mine = [j for message in queue.messages for j in message if day in j or hour in j]
    assert len(mine) == 70
    assert all(hour in j for j in mine[:30]), "the 1h batch's lines did not all go before the 24h batch's"
    assert [int(j.rsplit("_", 1)[1]) for j in mine[:30]] == list(range(1, 31))  # line order within it


def test_weights_set_with_the_cli_share_the_room_in_proportion(
    client: FlaskClient,
    services,
    stores: Stores,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    heavy, light = f"tenant-w3-{secrets.token_hex(3)}", f"tenant-w1-{secrets.token_hex(3)}"
    a, b = services.keys.create_key(heavy), services.keys.create_key(light)
    monkeypatch.setenv("LLMQ_DATABASE_URL", stores.database_url)
    assert cli(["tenants", "set", heavy, "--weight", "3"]) == 0
    assert "fair-share weight 3" in capsys.readouterr().out
    assert cli(["tenants", "set", light, "--weight", "0"]) == 1
    assert "above 0" in capsys.readouterr().err
    first = make_windowed_batch(client, a, 200, "24h")
    second = make_windowed_batch(client, b, 200, "24h")
    queue = RecordingQueue()
    lifecycle = BatchLifecycle(services.db, queue, services.events, window=100_000, chunk=8)  # type: ignore[arg-type]
    lifecycle.feed()
    # Other tests' leftover lines may go out too: look at these two batches' lines only.
    ours = [j for message in queue.messages for j in message if first in j or second in j]
    assert len(ours) == 400
    head = ours[:100]  # both tenants still have lines waiting all through these
    assert 70 <= sum(first in j for j in head) <= 80, "a weight-3 tenant should get about 3 of every 4 lines"


@pytest.mark.parametrize(("window", "status"), [("30m", 400), ("8d", 400), ("90m", 200), ("7d", 200)])
def test_completion_window_runs_from_an_hour_to_a_week(
    client: FlaskClient, tenant, window: str, status: int
) -> None:
    _, key = tenant
    r = upload(client, key, jsonl([line(1)]))
    r = client.post(
        "/v1/batches",
        json={
            "input_file_id": r.get_json()["id"],
            "endpoint": "/v1/chat/completions",
            "completion_window": window,
        },
        headers=auth(key),
    )
    assert r.status_code == status, r.get_json()
    if status == 400:
        assert r.get_json()["error"]["param"] == "completion_window"
    else:
        batch = r.get_json()
        assert batch["expires_at"] - batch["created_at"] == window_seconds(window)
