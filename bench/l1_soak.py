"""L1: a soak at 80 % of the measured maximum submit rate.

First a probe measures how many `POST /v2/jobs` per second the API accepts with 32
clients in a closed loop. Then an open-loop pacer submits at `fraction` of that rate for
`minutes` (10 by default), on one worker with the instant engine, and every few seconds
records errors, submit latency (p50/p99, measured from the scheduled send time, so a
stall counts), queue depth (jobs queued or running, from Postgres) and the RSS of the API
and worker process trees. Writes bench/results/l1_soak.json and l1_soak.png, and says
whether queue depth and memory stayed flat (second half against the first).

    python -m bench.l1_soak [--minutes 10] [--fraction 0.8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
import psutil
from sqlalchemy import text

from app.cli.stack import Stack
from app.connections import ADMIN_POOL
from app.db import Database
from bench.common import RESULTS, save, service

MODEL = "soak"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "soak"}], "max_tokens": 8}
SAMPLE_SECONDS = 5.0


@dataclass
class Window:
    """What happened in one sampling window."""

    t: float
    sent: int = 0
    errors: int = 0
    latencies: list[float] = field(default_factory=list)
    queue_depth: int = 0
    rss_api_mb: float = 0.0
    rss_worker_mb: float = 0.0

    def summary(self) -> dict[str, Any]:
        lat = sorted(self.latencies)
        return {
            "t": round(self.t, 1),
            "sent": self.sent,
            "errors": self.errors,
            "p50_ms": round(1e3 * lat[len(lat) // 2], 2) if lat else None,
            "p99_ms": round(1e3 * lat[min(len(lat) - 1, int(len(lat) * 0.99))], 2) if lat else None,
            "queue_depth": self.queue_depth,
            "rss_api_mb": round(self.rss_api_mb, 1),
            "rss_worker_mb": round(self.rss_worker_mb, 1),
        }


def tree_rss_mb(proc: Any) -> float:
    try:
        root = psutil.Process(proc.pid)
        return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)]) / 2**20
    except psutil.Error:
        return 0.0


def probe(stack: Stack, seconds: float = 15.0, clients: int = 32) -> float:
    """The most submits per second the API sustains, closed loop."""
    stop = time.monotonic() + seconds
    counts = [0] * clients
    limits = httpx.Limits(max_connections=clients)
    headers = {"Authorization": f"Bearer {stack.api_key}"}
    with httpx.Client(base_url=stack.base_url, headers=headers, limits=limits, timeout=30) as c:

        def loop(i: int) -> None:
            while time.monotonic() < stop:
                if c.post("/v2/jobs", json=BODY).status_code == 202:
                    counts[i] += 1

        start = time.monotonic()
        with ThreadPoolExecutor(clients) as pool:
            list(pool.map(loop, range(clients)))
        return sum(counts) / (time.monotonic() - start)


def wait_drained(db: Database, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and depth(db) > 0:
        time.sleep(1)


def depth(db: Database) -> int:
    with db.session() as s:
        return int(s.scalar(text("SELECT count(*) FROM jobs WHERE status IN ('queued', 'running')")) or 0)


def soak(stack: Stack, rate: float, minutes: float) -> list[Window]:
    db = Database.from_url(stack.env["LLMQ_DATABASE_URL"], ADMIN_POOL)
    windows: list[Window] = []
    lock = threading.Lock()
    start = time.monotonic()
    end = start + minutes * 60
    current = Window(0.0)
    headers = {"Authorization": f"Bearer {stack.api_key}"}
    limits = httpx.Limits(max_connections=64)

    def record(latency: float, ok: bool) -> None:
        with lock:
            current.sent += 1
            current.latencies.append(latency)
            if not ok:
                current.errors += 1

    with (
        httpx.Client(base_url=stack.base_url, headers=headers, limits=limits, timeout=30) as c,
        ThreadPoolExecutor(64) as pool,
    ):

        def send(due: float) -> None:
            try:
                ok = c.post("/v2/jobs", json=BODY).status_code == 202
            except httpx.HTTPError:
                ok = False
            record(time.monotonic() - due, ok)

        next_sample = start + SAMPLE_SECONDS
        n = 0
        while True:
            due = start + n / rate
            now = time.monotonic()
            if due >= end:
                break
            if now >= next_sample:
                with lock:
                    finished, current = current, Window(now - start)
                finished.queue_depth = depth(db)
                finished.rss_api_mb = tree_rss_mb(stack.procs["api"])
                finished.rss_worker_mb = tree_rss_mb(stack.procs["worker"])
                windows.append(finished)
                print(json.dumps(finished.summary()), flush=True)
                next_sample += SAMPLE_SECONDS
            if due > now:
                time.sleep(min(due - now, 0.01))
                continue
            pool.submit(send, due)
            n += 1
    db.dispose()
    return windows


def flat(values: list[float]) -> dict[str, Any]:
    """First half against second half; flat when the second is within 10 % (+ slack)."""
    half = len(values) // 2
    first, second = statistics.mean(values[:half]), statistics.mean(values[half:])
    return {"first_half": round(first, 1), "second_half": round(second, 1), "flat": second <= first * 1.1 + 5}


def plot(rows: list[dict[str, Any]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [r["t"] for r in rows]
    fig, axes = plt.subplots(4, 1, figsize=(9, 10), sharex=True)
    axes[0].plot(t, [r["sent"] / SAMPLE_SECONDS for r in rows], label="submits/s")
    axes[0].plot(t, [r["errors"] / SAMPLE_SECONDS for r in rows], label="errors/s", color="red")
    axes[1].plot(t, [r["p50_ms"] for r in rows], label="p50 ms")
    axes[1].plot(t, [r["p99_ms"] for r in rows], label="p99 ms")
    axes[2].plot(t, [r["queue_depth"] for r in rows], label="jobs queued or running")
    axes[3].plot(t, [r["rss_api_mb"] for r in rows], label="API RSS MB")
    axes[3].plot(t, [r["rss_worker_mb"] for r in rows], label="worker RSS MB")
    for ax in axes:
        ax.legend(loc="upper left")
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("seconds")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def run(minutes: float = 10.0, fraction: float = 0.8) -> dict[str, Any]:
    env = {
        "LLMQ_ENGINE": "instant",
        "LLMQ_RATE_LIMIT_PER_MINUTE": "0",
        "LLMQ_MAX_ACTIVE_JOBS_PER_TENANT": "0",
    }
    with service(MODEL, MODEL, **env) as stack:
        db = Database.from_url(stack.env["LLMQ_DATABASE_URL"], ADMIN_POOL)
        maximum = probe(stack)
        print(f"max submit rate {maximum:.0f}/s; soaking at {fraction:.0%} for {minutes} min", flush=True)
        wait_drained(db)
        db.dispose()
        windows = soak(stack, maximum * fraction, minutes)
    rows = [w.summary() for w in windows]
    latencies = sorted(x for w in windows for x in w.latencies)
    result = {
        "id": "L1",
        "max_submit_rate": round(maximum, 1),
        "soak_rate": round(maximum * fraction, 1),
        "minutes": minutes,
        "sent": sum(w.sent for w in windows),
        "errors": sum(w.errors for w in windows),
        "p50_ms": round(1e3 * latencies[len(latencies) // 2], 2),
        "p99_ms": round(1e3 * latencies[int(len(latencies) * 0.99)], 2),
        "queue_depth": flat([float(r["queue_depth"]) for r in rows]),
        "rss_api_mb": flat([r["rss_api_mb"] for r in rows]),
        "rss_worker_mb": flat([r["rss_worker_mb"] for r in rows]),
        "p99_latency_ms": flat([float(r["p99_ms"] or 0) for r in rows]),
        "windows": rows,
        "goal": "no errors; queue depth and memory flat",
    }
    save("l1_soak", result)
    plot(rows, str(RESULTS / "l1_soak.png"), f"L1 soak: {result['soak_rate']}/s for {minutes} min")
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--fraction", type=float, default=0.8)
    a = p.parse_args()
    result = run(a.minutes, a.fraction)
    print(json.dumps({k: v for k, v in result.items() if k != "windows"}, indent=2))


if __name__ == "__main__":
    main()
