"""R15, fleet in a box: the project's Procfile under honcho, 2 `web` and 3 `worker`
processes over two models on the machine's Postgres and Redis (tests/fleet/formation.py).

In file order: each model's jobs run only on its own pool; a 5,000-line batch spreads over
both workers of its model, takes a worker that joins half way within 10 s, loses and
repeats nothing when that worker is killed with `kill -9`, and the others carry on; both
API replicas report the same cluster figures; SIGTERM to honcho drains and stops it all.
"""

from __future__ import annotations

import io
import json
import os
import signal
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from tests.fleet.formation import HONCHO_KILL_WAIT_SECONDS, MODEL_A, MODEL_B, Formation
from tests.helpers import gone_within

BIG = 5000
SIDE = 300  # the other model's batch, run at the same time


def job_body(model: str, i: int, max_tokens: int = 4) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": f"fleet {i}"}], "max_tokens": max_tokens}


def submit_batch(client: httpx.Client, model: str, n: int, max_tokens: int = 4) -> str:
    data = "".join(
        json.dumps(
            {
                "custom_id": f"{model}-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": job_body(model, i, max_tokens),
            }
        )
        + "\n"
        for i in range(n)
    ).encode()
    f = client.post("/v1/files", data={"purpose": "batch"}, files={"file": ("in.jsonl", io.BytesIO(data))})
    assert f.status_code == 200, f.text[:1000]
    b = client.post(
        "/v1/batches",
        json={
            "input_file_id": f.json()["id"],
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        },
    )
    assert b.status_code == 200, b.text[:1000]
    return str(b.json()["id"])


def finished_by(fleet: Formation, batch_id: str) -> Counter[str]:
    """Finished lines of a batch per worker name."""
    rows = fleet.query(
        "SELECT finished_by, count(*) FROM jobs WHERE batch_id = %(b)s "
        "AND status NOT IN ('queued', 'running') GROUP BY 1",
        b=batch_id,
    )
    return Counter({str(name): int(n) for name, n in rows})


def holds_or_held(fleet: Formation, batch_id: str, worker: str) -> bool:
    """Whether `worker` runs or has run a line of the batch."""
    return bool(
        fleet.query(
            "SELECT 1 FROM jobs WHERE batch_id = %(b)s "
            "AND (lease_owner = %(w)s OR finished_by = %(w)s) LIMIT 1",
            b=batch_id,
            w=worker,
        )
    )


def wait_until(what: str, check: Any, timeout: float, fleet: Formation) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what} not within {timeout}s (logs in {fleet.root})"
        time.sleep(0.1)


def wait_batch(client: httpx.Client, batch_id: str, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        batch = client.get(f"/v1/batches/{batch_id}").json()
        if batch["status"] in ("completed", "failed", "expired", "cancelled"):
            return dict(batch)
        assert time.monotonic() < deadline, batch
        time.sleep(0.5)


def inv(fleet: Formation, client: httpx.Client, batch: dict[str, Any], n: int) -> None:
    """INV (RELIABILITY.md): n rows with distinct line numbers, each with one terminal
    result written by the holder of its last claim; the output and error files hold each
    custom_id exactly once."""
    ((rows, lines, unowned, open_rows),) = fleet.query(
        "SELECT count(*), count(DISTINCT line_no), "
        "count(*) FILTER (WHERE status = 'succeeded' AND (finished_by IS NULL OR response IS NULL)), "
        "count(*) FILTER (WHERE status IN ('queued', 'running')) "
        "FROM jobs WHERE batch_id = %(b)s",
        b=batch["id"],
    )
    assert (rows, lines, unowned, open_rows) == (n, n, 0, 0)
    ids: list[str] = []
    for name in ("output_file_id", "error_file_id"):
        if batch.get(name):
            content = client.get(f"/v1/files/{batch[name]}/content")
            assert content.status_code == 200
            ids += [json.loads(x)["custom_id"] for x in content.text.splitlines()]
    assert len(ids) == len(set(ids)) == n


def test_each_models_jobs_run_only_on_its_own_pool(fleet: Formation) -> None:
    pools = fleet.pools()
    assert {m: len(p) for m, p in pools.items()} == {MODEL_A: 2, MODEL_B: 1}
    clients = [fleet.client(0), fleet.client(1)]
    for c in clients:  # both replicas serve both models, each with its pool
        cards = {m["id"]: m for m in c.get("/v1/models").json()["data"]}
        assert {m: (cards[m]["live"], cards[m]["workers"]) for m in pools} == {
            MODEL_A: (True, 2),
            MODEL_B: (True, 1),
        }
    bodies = [job_body(model, i) for i in range(12) for model in (MODEL_A, MODEL_B)]
    with ThreadPoolExecutor(4) as pool:
        ids = list(
            pool.map(
                lambda ib: clients[ib[0] % 2].post("/v2/jobs", json=ib[1]).json()["id"], enumerate(bodies)
            )
        )
    jobs = {}
    for job_id in ids:
        jobs[job_id] = wait_until(
            f"job {job_id}",
            lambda j=job_id: (
                (body := clients[0].get(f"/v2/jobs/{j}").json())["status"] not in ("queued", "running")
                and body
            ),
            60,
            fleet,
        )
    for job in jobs.values():
        assert job["status"] == "succeeded", job
        assert job["finished_by"] in pools[job["model"]], job
    ran_on = {m: {j["finished_by"] for j in jobs.values() if j["model"] == m} for m in pools}
    assert ran_on[MODEL_B] == pools[MODEL_B]

    nobody = clients[1].post("/v2/jobs", json=job_body("fleet-nobody", 0))
    assert nobody.status_code == 404, nobody.text
    assert nobody.json()["error"]["code"] == "model_not_found"
    assert nobody.json()["error"]["param"] == "model"
    for c in clients:
        c.close()


def test_a_batch_spreads_takes_a_new_worker_and_survives_kill_9(fleet: Formation) -> None:
    pools = fleet.pools()
    a1, a2 = sorted(pools[MODEL_A])
    client, other = fleet.client(0), fleet.client(1)
    big = submit_batch(client, MODEL_A, BIG)
    side = submit_batch(other, MODEL_B, SIDE)

    # A fifth of the way, a worker of model A's pool starts; it takes lines within 10 s of
    # its start (the feeder's window grows with its capacity).
    wait_until("a fifth of the batch", lambda: sum(finished_by(fleet, big).values()) >= BIG // 5, 120, fleet)
    started = time.monotonic()
    joined = fleet.join(MODEL_A, timeout=10)
    (a3,) = {w["name"] for w in fleet.workers() if w["pid"] == joined.pid}
    left = 10 - (time.monotonic() - started)
    wait_until("the joined worker's first line", lambda: holds_or_held(fleet, big, a3), left, fleet)
    took = time.monotonic() - started

    # Once it is well into its share, it is killed with lines in flight.
    wait_until("the joined worker's share", lambda: finished_by(fleet, big)[a3] >= 200, 60, fleet)
    os.killpg(joined.pid, signal.SIGKILL)
    joined.wait(10)
    # What it held, read before the sweeper hands it back (its presence lapses in seconds).
    in_flight = {
        r[0]
        for r in fleet.query(
            "SELECT id FROM jobs WHERE batch_id = %(b)s AND status = 'running' AND lease_owner = %(w)s",
            b=big,
            w=a3,
        )
    }
    at_kill = finished_by(fleet, big)
    assert in_flight, "the killed worker had no line in flight"
    assert sum(at_kill.values()) < BIG, "the batch ended before the kill"

    # The others carry on: both finish more lines after the kill.
    wait_until(
        "both remaining workers finishing lines after the kill",
        lambda: all(finished_by(fleet, big)[w] > at_kill[w] + 50 for w in (a1, a2)),
        60,
        fleet,
    )
    done = wait_batch(client, big, 300)
    assert done["status"] == "completed", done
    assert done["request_counts"] == {"total": BIG, "completed": BIG, "failed": 0}
    inv(fleet, client, done, BIG)

    shares = finished_by(fleet, big)
    assert set(shares) == {a1, a2, a3}, shares  # model A's lines ran only on model A's pool
    assert shares[a3] == at_kill[a3]  # nothing written by the dead worker after its death
    for w in (a1, a2):
        assert shares[w] >= 0.3 * BIG, shares
    # The lines the dead worker held ran again, each once, on the survivors.
    rerun = fleet.query(
        "SELECT finished_by, count(*) FROM jobs WHERE id = ANY(%(ids)s) AND status = 'succeeded' GROUP BY 1",
        ids=list(in_flight),
    )
    assert {name for name, _ in rerun} <= {a1, a2} and sum(n for _, n in rerun) == len(in_flight)

    side_done = wait_batch(other, side, 120)
    assert side_done["status"] == "completed", side_done
    inv(fleet, other, side_done, SIDE)
    assert set(finished_by(fleet, side)) == pools[MODEL_B]
    print(
        f"joined: first line {took:.1f}s after its start; killed at {sum(at_kill.values())} of {BIG} "
        f"lines with {len(in_flight)} in flight; shares {sorted(shares.values())}"
    )
    client.close()
    other.close()


def scrape(url: str, key: str | None) -> dict[str, float]:
    """A /metrics answer as {series: value}, without the scrape's own timing."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    text = httpx.get(f"{url}/metrics", headers=headers, timeout=10).text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and not line.startswith("llmq_scrape_"):
            series, _, value = line.rpartition(" ")
            out[series] = float(value)
    return out


CLUSTER_FAMILIES = ("llmq_workers_consuming", "llmq_batches", "llmq_jobs_active", "llmq_queue_depth")


def test_one_replica_reports_the_cluster_figures_and_their_sum_is_the_clusters(fleet: Formation) -> None:
    # A worker that died has left the registry once its presence lapsed; the figures of a
    # fleet at rest do not move between two scrapes.
    sizes = wait_until(
        "the pools at rest", lambda: (s := fleet.pool_sizes()) == {MODEL_A: 2, MODEL_B: 1} and s, 30, fleet
    )
    ((batches,),) = fleet.query("SELECT count(*) FROM batches WHERE status = 'completed'")
    for key in (fleet.key, None):
        scrapes = [scrape(url, key) for url in fleet.web_urls()]
        assert len(scrapes) == 2
        assert sum(s["llmq_cluster_reporter"] for s in scrapes) == 1
        for s in scrapes:
            has = any(series.startswith(CLUSTER_FAMILIES) for series in s)
            assert has == (s["llmq_cluster_reporter"] == 1)
        for model, count in sizes.items():
            assert sum(s.get(f'llmq_workers_consuming{{model="{model}"}}', 0) for s in scrapes) == count
        assert sum(s.get('llmq_batches{status="completed"}', 0) for s in scrapes) == batches


def test_sigterm_drains_and_stops_the_formation(fleet: Formation) -> None:
    client = fleet.client(0)
    # Lines of 64 tokens take about 4 s on a worker, longer than its 2 s grace: those running
    # when SIGTERM lands cannot finish, and must be handed back.
    batch = submit_batch(client, MODEL_A, 600, max_tokens=64)
    wait_until(
        "lines running", lambda: fleet.query("SELECT 1 FROM jobs WHERE status = 'running' LIMIT 1"), 30, fleet
    )
    client.close()
    pids = fleet.formation_pids()
    assert len(pids) >= 5, pids
    took = fleet.sigterm()
    log = fleet.log()
    assert "SIGKILL" not in log, log[-4000:]
    assert took < HONCHO_KILL_WAIT_SECONDS, (took, log[-4000:])
    assert gone_within(pids, 0) == {}
    # Nothing is left claimed: what did not finish within the grace went back to the queue.
    ((running, held),) = fleet.query(
        "SELECT count(*) FILTER (WHERE status = 'running'), "
        "count(*) FILTER (WHERE status = 'queued' AND lease_owner IS NOT NULL) FROM jobs"
    )
    assert (running, held) == (0, 0)
    ((finished, waiting, handed_back),) = fleet.query(
        "SELECT count(*) FILTER (WHERE status = 'succeeded'), count(*) FILTER (WHERE status = 'queued'), "
        "count(*) FILTER (WHERE status = 'queued' AND attempts > 0) FROM jobs WHERE batch_id = %(b)s",
        b=batch,
    )
    assert finished + waiting == 600
    assert handed_back > 0  # lines that were running went back to the queue, not lost
