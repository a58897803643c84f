"""B7 scale-out: one 20,000-line batch on 1, 2, 4 and 8 workers running the simulated GPU
engine (`LLMQ_ENGINE=simulated`, `max_num_seqs` 256), through the whole product: the API
under gunicorn, the batch file upload, the feeder, Redis, real `python -m worker` Celery
processes and Postgres.

Reports lines/s per size, scaling efficiency (throughput(N) / (N × throughput(1))) and each
worker's slot utilisation: the time-averaged share of its `max_num_seqs` engine slots that
ran a line, from the first line started to the last (while lines were waiting). Goals:
efficiency ≥ 0.9 at 8 workers, utilisation ≥ 0.9.

The simulated speed is chosen so that 8 workers together need ~510 lines/s, well under what
this 2-core box moves (B2: ~1,100-1,450 lines/s), so what is measured is dispatch, not the
CPUs: a step is 50 ms + 1.6 ms per running sequence (+0.05 ms per prompt token admitted),
every line asks for 8 tokens, so one full worker makes 256 lines per ~8 × 0.47 s ≈ 64 lines/s.

`python -m bench.b7_scale [--quick]` (quick: 5,000 lines, a smoke run of a couple of minutes;
its efficiency is lower, as the ramp and the tail weigh more in a short run). Run it under
`flock /tmp/llmq-heavy.lock` on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil
import redis
from sqlalchemy import text

from app.cli.client import LlmqClient
from app.cli.stack import Stack
from app.connections import ADMIN_POOL
from app.db import Database
from app.services.health import live_workers
from bench.common import ROOT, save, service

SERVED = "bench-b7-sim"
MAX_NUM_SEQS = 256
MAX_TOKENS = 8
SIZES = (1, 2, 4, 8)
ENV = {
    "LLMQ_ENGINE": "simulated",
    "LLMQ_MAX_NUM_SEQS": str(MAX_NUM_SEQS),
    "LLMQ_SIM_STEP_MS": "50",
    "LLMQ_SIM_STEP_MS_PER_SEQ": "1.6",
    "LLMQ_SIM_PREFILL_MS_PER_TOKEN": "0.05",
    # No LLMQ_BATCH_DISPATCH_WINDOW: the feeder's window follows the live workers'
    # registered capacity (headroom × N × LLMQ_MAX_INFLIGHT, app/services/dispatch.py), as
    # a deployment runs it.
    "LLMQ_RATE_LIMIT_PER_MINUTE": "0",
}


def write_batch(path: Path, lines: int) -> None:
    with path.open("w") as f:
        for i in range(lines):
            body = {
                "model": SERVED,
                "messages": [{"role": "user", "content": f"B7 line {i}: say something."}],
                "max_tokens": MAX_TOKENS,
            }
            f.write(
                json.dumps(
                    {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
                )
                + "\n"
            )


class Fleet:
    """The stack's own worker plus extra `python -m worker` processes, as a deployment
    adds them: same environment, same model, same queue."""

    def __init__(self, stack: Stack, env: dict[str, str], logs: Path) -> None:
        self._stack = stack
        self._env = {**os.environ, **env, **stack.env, "PYTHONUNBUFFERED": "1"}
        self._logs = logs
        self.extra: list[subprocess.Popen[bytes]] = []
        self._redis = redis.Redis.from_url(stack.env["LLMQ_REDIS_URL"])

    def live(self) -> list[dict[str, Any]]:
        return [w for w in live_workers(self._redis) if w.get("model") == SERVED]

    def grow(self, size: int, timeout: float = 120) -> None:
        while 1 + len(self.extra) < size:
            log = (self._logs / f"worker-{len(self.extra) + 2}.log").open("ab")
            self.extra.append(
                subprocess.Popen(
                    [sys.executable, "-m", "worker"],
                    env=self._env,
                    cwd=ROOT,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        deadline = time.monotonic() + timeout
        while len(self.live()) < size:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(self.live())}/{size} workers live; logs in {self._logs}")
            time.sleep(0.5)

    def pids(self) -> list[int]:
        return [self._stack.procs["worker"].pid, *(p.pid for p in self.extra)]

    def stop(self) -> None:
        for proc in self.extra:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.extra:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU of these processes and all their children."""
    total = 0.0
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            for p in [proc, *proc.children(recursive=True)]:
                times = p.cpu_times()
                total += times.user + times.system
        except psutil.NoSuchProcess:
            continue
    return total


def utilisation(rows: list[Any], start: datetime, end: datetime, slots: int) -> dict[str, float]:
    """Per worker, the time-averaged min(lines claimed, `slots`) / `slots` over [start, end]:
    the engine runs up to `slots` of the lines a worker holds; the rest wait in it."""
    changes: dict[str, list[tuple[float, int]]] = defaultdict(list)
    t0 = start.timestamp()
    for r in rows:
        changes[r.finished_by].append((r.started_at.timestamp() - t0, 1))
        changes[r.finished_by].append((r.succeeded_at.timestamp() - t0, -1))
    span = end.timestamp() - t0
    out: dict[str, float] = {}
    for worker, events in changes.items():
        events.sort()
        held, last, area = 0, 0.0, 0.0
        for when, step in events:
            at = min(max(when, 0.0), span)
            area += min(held, slots) * (at - last)
            held, last = held + step, at
        area += min(held, slots) * (span - last)
        out[worker] = round(area / (slots * span), 3) if span > 0 else 0.0
    return out


def measure(db: Database, batch_id: str) -> dict[str, Any]:
    with db.session() as s:
        batch = s.execute(
            text("SELECT created_at, in_progress_at FROM batches WHERE id = :id"), {"id": batch_id}
        ).one()
        rows = s.execute(
            text(
                "SELECT finished_by, started_at, succeeded_at FROM jobs "
                "WHERE batch_id = :id AND status = 'succeeded'"
            ),
            {"id": batch_id},
        ).all()
        attempts = s.scalar(text("SELECT max(attempts) FROM jobs WHERE batch_id = :id"), {"id": batch_id})
    first_start = min(r.started_at for r in rows)
    last_start = max(r.started_at for r in rows)
    last_end = max(r.succeeded_at for r in rows)
    run_s = (last_end - batch.in_progress_at).total_seconds()
    per_worker = defaultdict(int)
    for r in rows:
        per_worker[r.finished_by] += 1
    util = utilisation(rows, first_start, last_start, MAX_NUM_SEQS)
    return {
        "succeeded": len(rows),
        "max_attempts": attempts,
        "run_s": round(run_s, 2),
        "lines_per_s": round(len(rows) / run_s, 1),
        "first_line_s": round((first_start - batch.in_progress_at).total_seconds(), 2),
        "waiting_s": round((last_start - first_start).total_seconds(), 2),
        "utilisation": dict(sorted(util.items())),
        "utilisation_min": min(util.values()),
        "lines_by_worker": sorted(per_worker.values()),
    }


def one(
    client: LlmqClient, db: Database, fleet: Fleet, stack: Stack, path: Path, size: int
) -> dict[str, Any]:
    fleet.grow(size)
    started = time.perf_counter()
    uploaded = client.upload_batch_file(path)
    batch = client.create_batch(uploaded["id"], window="24h")
    ingest_s = time.perf_counter() - started
    pids = {
        "api": [stack.procs["api"].pid],
        "workers": fleet.pids(),
        "stores": [server.proc.pid for server in stack.servers],
    }
    cpu_before = {name: cpu_seconds(p) for name, p in pids.items()}
    connections = 0
    while batch["status"] not in ("completed", "failed", "expired", "cancelled"):
        time.sleep(0.5)
        batch = client.get_batch(batch["id"])
        with db.session() as s:
            connections = max(connections, int(s.scalar(text("SELECT count(*) FROM pg_stat_activity")) or 0))
    if batch["status"] != "completed":
        raise RuntimeError(f"batch ended {batch['status']}: {batch}")
    cpu = {name: cpu_seconds(p) - cpu_before[name] for name, p in pids.items()}
    figures = measure(db, batch["id"])
    lines = figures["succeeded"]
    rss = [psutil.Process(pid).memory_info().rss for pid in fleet.pids()]
    return {
        "workers": size,
        "ingest_s": round(ingest_s, 2),
        **figures,
        "cpu_ms_per_line": {name: round(s * 1e3 / lines, 3) for name, s in cpu.items()},
        "worker_rss_mb": round(max(rss) / 2**20, 1),
        "pg_connections_peak": connections,
    }


def run(lines: int = 20_000, sizes: tuple[int, ...] = SIZES) -> dict[str, Any]:
    path = Path(tempfile.mkdtemp()) / f"b7-{lines}.jsonl"
    write_batch(path, lines)
    logs = Path(tempfile.mkdtemp(prefix="llmq-b7-logs-"))
    runs: list[dict[str, Any]] = []
    with service(SERVED, SERVED, **ENV) as stack:
        fleet = Fleet(stack, {**ENV, "LLMQ_SERVED_MODEL_NAME": SERVED, "LLMQ_LOG_LEVEL": "WARNING"}, logs)
        db = Database.from_url(stack.env["LLMQ_DATABASE_URL"], ADMIN_POOL)
        client = LlmqClient(stack.base_url, stack.api_key, timeout=600)
        try:
            for size in sizes:
                runs.append(one(client, db, fleet, stack, path, size))
                print(json.dumps(runs[-1]), flush=True)
        finally:
            client.close()
            db.dispose()
            fleet.stop()
    base = runs[0]["lines_per_s"] / runs[0]["workers"]
    for r in runs:
        r["efficiency"] = round(r["lines_per_s"] / (r["workers"] * base), 3)
    last = runs[-1]
    result = {
        "id": "B7",
        "lines": lines,
        "lines_per_s": {str(r["workers"]): r["lines_per_s"] for r in runs},
        "efficiency": {str(r["workers"]): r["efficiency"] for r in runs},
        "utilisation_min": {str(r["workers"]): r["utilisation_min"] for r in runs},
        "runs": runs,
        "engine": {k: v for k, v in ENV.items() if k.startswith("LLMQ_SIM") or k == "LLMQ_MAX_NUM_SEQS"},
        "max_tokens": MAX_TOKENS,
        "goal": "efficiency >= 0.9 at 8 workers; utilisation >= 0.9",
        "met": last["efficiency"] >= 0.9 and min(r["utilisation_min"] for r in runs) >= 0.9,
    }
    save("b7" if (lines, sizes) == (20_000, SIZES) else f"b7_{lines}_{'-'.join(map(str, sizes))}", result)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="5,000 lines: a smoke run of a couple of minutes")
    p.add_argument("--lines", type=int, default=None, help="batch size (default 20,000)")
    p.add_argument("--sizes", default=",".join(map(str, SIZES)), help="worker counts, ascending")
    a = p.parse_args()
    sizes = tuple(int(x) for x in a.sizes.split(","))
    result = run(a.lines or (5_000 if a.quick else 20_000), sizes)
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))


if __name__ == "__main__":
    main()
