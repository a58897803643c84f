"""`kill -9` a worker (and its engine) while jobs run, start another: every accepted job
ends with exactly one result; jobs finished before the kill are not regenerated."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from flask.testing import FlaskClient
from sqlalchemy import text

from app.api import create_app
from app.container import build_services
from tests.helpers import Stores, WorkerProcess, auth, make_settings, stack_env

pytestmark = pytest.mark.integration

MODEL = "tiny-crash"


def test_kill_9_worker_mid_run_then_restart(stores: Stores, tiny_model: Path, logs_dir: Path) -> None:
    settings = make_settings(stores, model=str(tiny_model), served_model_name=MODEL)
    services = build_services(settings)
    client: FlaskClient = create_app(services=services).test_client()
    key = services.keys.create_key("tenant-crash")
    env = stack_env(stores, tiny_model, MODEL)

    first = WorkerProcess(env, logs_dir / "crash-worker-1.log").start()
    sizes = [16, 16, 16] + [1800] * 9
    ids = []
    for n in sizes:
        r = client.post(
            "/v2/jobs",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": "go"}],
                "max_tokens": n,
                "ignore_eos": True,
            },
            headers=auth(key),
        )
        assert r.status_code == 202
        ids.append(r.get_json()["id"])

    def rows() -> dict[str, dict]:
        with services.db.session() as s:
            result = s.execute(
                text(
                    "SELECT id, status, attempts, epoch, finished_by, succeeded_at, usage "
                    "FROM jobs WHERE id = ANY(:ids)"
                ),
                {"ids": ids},
            ).mappings()
            return {r["id"]: dict(r) for r in result}

    deadline = time.monotonic() + 120
    while True:
        state = rows()
        short_done = all(state[i]["status"] == "succeeded" for i in ids[:3])
        long_running = sum(state[i]["status"] == "running" for i in ids[3:])
        if short_done and long_running >= 4:
            break
        assert time.monotonic() < deadline, state
        time.sleep(0.1)
    before = rows()
    first.kill(signal.SIGKILL)

    second = WorkerProcess(env, logs_dir / "crash-worker-2.log").start()
    try:
        deadline = time.monotonic() + 240
        while not all(r["status"] in ("succeeded", "failed", "cancelled") for r in rows().values()):
            assert time.monotonic() < deadline, (rows(), second.log_path.read_text(errors="replace")[-4000:])
            time.sleep(0.5)
        after = rows()
    finally:
        second.stop()
        services.close()

    first_name = f"llmq-{first.proc.pid}@"  # type: ignore[union-attr]
    second_name = f"llmq-{second.proc.pid}@"  # type: ignore[union-attr]
    for job_id, n in zip(ids, sizes, strict=True):
        row = after[job_id]
        assert row["status"] == "succeeded", row
        assert row["usage"]["completion_tokens"] == n
        assert row["attempts"] <= 2
    # Finished before the kill: untouched (same epoch, same time, same writer).
    for job_id in ids[:3]:
        assert after[job_id]["succeeded_at"] == before[job_id]["succeeded_at"]
        assert after[job_id]["epoch"] == 1 and after[job_id]["finished_by"].startswith(first_name)
    # In flight at the kill: run again by the second worker under a new epoch.
    rerun = [i for i in ids[3:] if before[i]["status"] == "running"]
    assert rerun
    for job_id in rerun:
        assert after[job_id]["epoch"] == 2 and after[job_id]["attempts"] == 2
        assert after[job_id]["finished_by"].startswith(second_name)
