"""Shared pieces of the benchmarks: a service stack, job submission, timing from Postgres."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import text

from app.cli.embedded import free_port
from app.cli.stack import Stack
from app.connections import ADMIN_POOL
from app.db import Database
from app.settings import Settings
from bench.load import burst

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


@contextmanager
def service(model: str, served_name: str, **env: str) -> Iterator[Stack]:
    """API + one worker on `model`, against LLMQ_DATABASE_URL/LLMQ_REDIS_URL when set, else
    embedded stores in a temporary data dir."""
    settings = Settings()
    data_dir = Path(tempfile.mkdtemp(prefix="llmq-bench-"))
    data_dir.chmod(0o755)
    # Logs at the level `llmq up` and the Procfile keep by default (INFO: the API writes two
    # lines a job, the worker four), into the data dir's log files as `llmq up` does.
    child_env = {
        "LLMQ_MODEL": model,
        "LLMQ_SERVED_MODEL_NAME": served_name,
        **env,
    }
    stack = Stack(
        settings.model_copy(update={"model": model}),
        host="127.0.0.1",
        port=free_port(18900),
        data_dir=data_dir,
        child_env=child_env,
    )
    try:
        stack.start()
        if not stack.wait_ready(600):
            raise RuntimeError("service did not become ready")
        yield stack
    finally:
        stack.stop()


def script_json(module: str, *args: str) -> Any:
    """Run `python -m <module> <args>` in a process of its own (vLLM's baselines: the engine
    must be built under __main__) and return the JSON of the last line it printed."""
    out = subprocess.run(
        [sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def submit_all(stack: Stack, bodies: list[dict[str, Any]], threads: int = 64) -> list[str]:
    """`POST /v2/jobs` of every body, `threads` at once (bench/load.py's `burst`); the job ids
    in body order."""
    auth = {"Authorization": f"Bearer {stack.api_key}"}
    return [str(answer["id"]) for answer in burst(stack.base_url, "/v2/jobs", bodies, auth, threads)]


# While the jobs run: is any still queued or running? Reading every job's figures at each
# poll instead took Postgres about 1.2 ms a poll at 512 jobs: 0.17 / 0.25 ms a job, at 64 /
# 512, of what B1 reported as the service's Postgres, against 0.016 / 0.022 ms for this
# (pg_stat_statements' execution time under B1's load).
_ANY_ACTIVE = text(
    "SELECT EXISTS (SELECT 1 FROM jobs WHERE id = ANY(:ids) AND status IN ('queued', 'running'))"
)
# Once they have ended: the figures, read once.
_FIGURES = text(
    "SELECT count(*) AS done, "
    "count(*) FILTER (WHERE status = 'succeeded') AS ok, "
    "extract(epoch FROM max(succeeded_at) - min(created_at)) AS wall, "
    "extract(epoch FROM max(started_at) - min(created_at)) AS last_start, "
    "sum((usage->>'completion_tokens')::int) AS tokens "
    "FROM jobs WHERE id = ANY(:ids)"
)


def wait_done(stack: Stack, ids: list[str], timeout: float = 1800) -> dict[str, float]:
    """Wait for every job to end; timings come from Postgres (read once, at the end: the
    polls while the jobs run ask only whether one is left, so that the CPU measured around
    a run is the service's)."""
    db = Database.from_url(stack.env["LLMQ_DATABASE_URL"], ADMIN_POOL)
    try:
        deadline = time.monotonic() + timeout
        while True:
            with db.session() as s:
                active = s.execute(_ANY_ACTIVE, {"ids": ids}).scalar_one()
            if not active:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"jobs still queued or running after {timeout:.0f} s")
            time.sleep(0.25)
        with db.session() as s:
            row = s.execute(_FIGURES, {"ids": ids}).one()
        if row.done != len(ids):
            raise RuntimeError(f"{len(ids) - row.done} of {len(ids)} jobs are missing")
        return {
            "ok": float(row.ok),
            "wall": float(row.wall),
            "tokens": float(row.tokens or 0),
            # When the last job was first claimed by a worker, from the first submit.
            "last_start": float(row.last_start or 0),
        }
    finally:
        db.dispose()


def save(name: str, result: dict[str, Any]) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2))
