"""RELIABILITY.md's scenarios, each a fault injected into the running stack, each ending
with INV. R1, R9 and R11 with vLLM are in tests/integration/test_batches.py; S1-S4 in
tests/integration/test_streaming.py and test_redis_restart.py; R12 in tests/api/test_limits.py."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import psutil
import pytest
import redis
from sqlalchemy import text

from app.services.health import live_workers
from tests.faults.conftest import MODEL, FaultStack
from tests.faults.crashing_worker import CRASH_MARKER, ENGINE_CRASH_CHOICE
from tests.helpers import WorkerProcess, auth, gone_within, stack_env

pytestmark = pytest.mark.faults

DONE = "status IN ('succeeded', 'failed', 'cancelled', 'expired')"


def log_text(worker: WorkerProcess) -> str:
    return worker.log_path.read_text(errors="replace")


def wait_unready(stack: FaultStack, timeout: float = 30) -> None:
    """Until the API's readiness check sees the outage (a store down), not a fixed time."""
    deadline = time.monotonic() + timeout
    while stack.client.get("/readyz").status_code == 200:
        assert time.monotonic() < deadline, "the outage was never seen by /readyz"
        time.sleep(0.1)


def test_r1_kill_9_half_way_keeps_finished_lines(fault_stack: FaultStack) -> None:
    first = fault_stack.worker("r1-a")
    batch = fault_stack.batch(300, max_tokens=100)
    fault_stack.wait_rows(batch, "status = 'succeeded'", 150)
    first.kill(signal.SIGKILL)
    before = fault_stack.rows(batch, "status = 'succeeded'")
    fault_stack.worker("r1-b")
    done = fault_stack.wait_batch(batch)
    assert done["status"] == "completed" and done["request_counts"]["completed"] == 300
    after = fault_stack.rows(batch, "status = 'succeeded'")
    assert {k: after[k] for k in before} == before
    fault_stack.inv(batch, 300)


def test_r3_redelivery_past_visibility_timeout_never_runs_a_line_twice(fault_stack: FaultStack) -> None:
    short = {"LLMQ_VISIBILITY_TIMEOUT_SECONDS": "2"}
    fault_stack.worker("r3-a", **short)
    fault_stack.worker("r3-b", **short)
    batch = fault_stack.batch(64, max_tokens=500)  # 5 s a line, past the 2 s visibility timeout
    done = fault_stack.wait_batch(batch, timeout=180)
    assert done["status"] == "completed"
    rows = fault_stack.rows(batch)
    assert all(r["attempts"] == 1 and r["epoch"] == 1 for r in rows.values()), "a line was claimed twice"
    fault_stack.inv(batch, 64)


def test_r4_paused_worker_is_fenced_off(fault_stack: FaultStack) -> None:
    stale = fault_stack.worker("r4-a")
    batch = fault_stack.batch(48, max_tokens=400)  # 4 s a line
    fault_stack.wait_rows(batch, "status = 'running'", 16)
    os.killpg(stale.proc.pid, signal.SIGSTOP)  # type: ignore[union-attr]
    taken = set(fault_stack.rows(batch, "status = 'running'"))
    fault_stack.worker("r4-b")
    # Its leases lapse (3 s), the sweeper of the new worker requeues them, the new one runs them.
    fault_stack.wait_rows(batch, "status = 'succeeded' AND attempts = 2", 1, timeout=60)
    # Resume the stale worker only once every line it held was taken over by the new one,
    # so each of its late writes meets a newer epoch.
    held = ", ".join(f"'{job_id}'" for job_id in taken)
    fault_stack.wait_rows(batch, f"id IN ({held}) AND attempts >= 2", len(taken), timeout=120)
    os.killpg(stale.proc.pid, signal.SIGCONT)  # type: ignore[union-attr]
    done = fault_stack.wait_batch(batch, timeout=180)
    assert done["status"] == "completed"
    rows = fault_stack.rows(batch)
    stale_name = f"llmq-{stale.proc.pid}@"  # type: ignore[union-attr]
    for job_id in taken:
        assert rows[job_id]["epoch"] >= 2
        assert not rows[job_id]["finished_by"].startswith(stale_name), "a stale write got through"
    fault_stack.inv(batch, 48)


def test_r5_redis_restart_during_enqueue_and_processing(fault_stack: FaultStack) -> None:
    worker = fault_stack.worker("r5")
    batch = fault_stack.batch(200, max_tokens=50)
    fault_stack.wait_rows(batch, "status = 'succeeded'", 40)
    fault_stack.stop_redis()
    # Submitted while Redis is down: accepted and durable.
    body = {"model": MODEL, "messages": [{"role": "user", "content": "during the outage"}], "max_tokens": 5}
    during = fault_stack.client.post("/v2/jobs", json=body, headers=auth(fault_stack.key))
    wait_unready(fault_stack)
    fault_stack.start_redis()
    restarted = time.monotonic()
    done = fault_stack.wait_batch(batch, timeout=180)
    assert done["status"] == "completed" and done["request_counts"]["completed"] == 200
    fault_stack.inv(batch, 200)
    assert during.status_code == 202
    deadline = time.monotonic() + 60
    while (
        fault_stack.client.get(
            f"/v2/jobs/{during.get_json()['id']}", headers=auth(fault_stack.key)
        ).get_json()["status"]
        != "succeeded"
    ):
        assert time.monotonic() < deadline
        time.sleep(0.3)
    # The worker consumes again (its registry entry proves a broker round trip) within 30 s.
    r = redis.Redis.from_url(fault_stack.redis.url)
    while not any(w.get("name", "").startswith(f"llmq-{worker.proc.pid}@") for w in live_workers(r)):  # type: ignore[union-attr]
        assert time.monotonic() - restarted < 30
        time.sleep(0.5)


def test_r6_redis_down_at_submit_is_durable_and_runs_once(fault_stack: FaultStack) -> None:
    fault_stack.stop_redis()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5}
    r = fault_stack.client.post("/v2/jobs", json=body, headers=auth(fault_stack.key))
    assert r.status_code == 202
    job_id = r.get_json()["id"]
    fault_stack.start_redis()
    fault_stack.worker("r6")
    deadline = time.monotonic() + 60
    while (job := fault_stack.client.get(f"/v2/jobs/{job_id}", headers=auth(fault_stack.key)).get_json())[
        "status"
    ] != "succeeded":
        assert time.monotonic() < deadline, job
        time.sleep(0.3)
    assert job["attempts"] == 1


def test_r7_postgres_restart_while_results_are_written(fault_stack: FaultStack) -> None:
    worker = fault_stack.worker("r7")
    # Lines of 3 s each (300 tokens at 10 ms) run in waves that end together. Postgres goes
    # once some results are stored and a line was claimed within the last second: that
    # line's result is written 2 s or more later, into the outage. (Stopped between two
    # waves, nothing would be left to write until it is back; and a row still read as
    # running may be one whose result is being committed that moment: CI saw both.)
    batch = fault_stack.batch(200, max_tokens=300)
    fault_stack.wait_rows(batch, "status = 'succeeded'", 40)
    fault_stack.wait_rows(batch, "status = 'running' AND started_at > now() - interval '1 second'", 1)
    fault_stack.stop_pg()
    # Down until the worker has met the outage (a result write retried), not a fixed time.
    deadline = time.monotonic() + 60
    while "retrying the write" not in log_text(worker):
        assert time.monotonic() < deadline, "the worker never met the outage"
        time.sleep(0.2)
    fault_stack.start_pg()
    done = fault_stack.wait_batch(batch, timeout=180)
    assert done["status"] == "completed" and done["request_counts"]["completed"] == 200
    fault_stack.inv(batch, 200)
    assert "retrying the write" in log_text(worker) or "database" in log_text(worker)


def test_r8_sigterm_mid_batch_redoes_at_most_the_window(fault_stack: FaultStack) -> None:
    first = fault_stack.worker("r8-a")
    batch = fault_stack.batch(300, max_tokens=100)
    fault_stack.wait_rows(batch, "status = 'succeeded'", 100)
    first.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
    first.proc.wait(60)  # type: ignore[union-attr]
    assert first.proc.returncode == 0  # type: ignore[union-attr]
    fault_stack.worker("r8-b")
    done = fault_stack.wait_batch(batch, timeout=180)
    assert done["status"] == "completed"
    redone = fault_stack.rows(batch, "attempts > 1")
    assert len(redone) <= 64  # the dispatch window
    fault_stack.inv(batch, 300)


def test_r10_a_job_that_kills_its_worker_ends_failed(fault_stack: FaultStack) -> None:
    special = {7: f"please {CRASH_MARKER}"}
    batch = fault_stack.batch(40, max_tokens=10, special=special)
    deadline = time.monotonic() + 240
    while fault_stack.get_batch(batch)["status"] not in ("completed", "failed"):
        assert time.monotonic() < deadline, fault_stack.describe(batch)
        alive = [w for w in fault_stack.workers if w.proc is not None and w.proc.poll() is None]
        if not alive:
            # What a supervisor does; the poison line may kill it before it is ready.
            with contextlib.suppress(RuntimeError):
                # One chunk out at a time: what dies with the poison line is its own chunk,
                # whatever the timing (co-running bystanders spend attempts too).
                fault_stack.worker(f"r10-{len(fault_stack.workers)}", LLMQ_BATCH_DISPATCH_WINDOW="16")
        time.sleep(0.5)
    done = fault_stack.get_batch(batch)
    assert done["request_counts"]["failed"] >= 1 and done["request_counts"]["completed"] >= 39 - 16
    poison = fault_stack.rows(batch, "custom_id = 'line-7'")
    (row,) = poison.values()
    assert row["status"] == "failed" and row["attempts"] == 3
    _, errors = fault_stack.inv(batch, 40)
    failed = {e["custom_id"]: e for e in errors}
    assert failed["line-7"]["response"]["body"]["error"]["code"] == "attempts_exhausted"


def test_r2_engine_process_dies_worker_restarts(fault_stack: FaultStack, tiny_model: Path) -> None:
    """The engine, not the worker, dies: the worker says so, stops consuming and exits (a
    supervisor restarts it); its lines are handed back and finish elsewhere."""
    env = stack_env(
        fault_stack.stores,
        tiny_model,
        MODEL,
        LLMQ_LEASE_SECONDS="3",
        LLMQ_SWEEPER_INTERVAL_SECONDS="0.5",
        LLMQ_BATCH_TICK_SECONDS="0.1",
        LLMQ_BATCH_DISPATCH_WINDOW="64",
        LLMQ_BATCH_CHUNK_SIZE="16",
    )
    first = WorkerProcess(env, fault_stack.logs / "r2-a.log").start()
    fault_stack.workers.append(first)
    batch = fault_stack.batch(200, max_tokens=64)
    fault_stack.wait_rows(batch, "status = 'succeeded'", 30, timeout=120)
    engine = [
        p
        for p in psutil.Process(first.proc.pid).children(recursive=True)
        if "EngineCore" in " ".join(p.cmdline())
    ]  # type: ignore[union-attr]
    assert engine
    engine[0].kill()
    first.proc.wait(120)  # type: ignore[union-attr]
    assert "engine is dead" in log_text(first) or "engine died" in log_text(first)
    r = redis.Redis.from_url(fault_stack.redis.url)
    assert not any(w.get("name", "").startswith(f"llmq-{first.proc.pid}@") for w in live_workers(r))  # type: ignore[union-attr]
    second = WorkerProcess(env, fault_stack.logs / "r2-b.log").start()
    fault_stack.workers.append(second)
    done = fault_stack.wait_batch(batch, timeout=300)
    assert done["status"] == "completed" and done["request_counts"]["completed"] == 200
    fault_stack.inv(batch, 200)


def test_r13_kill_9_of_a_worker_takes_its_engine_processes_with_it(
    fault_stack: FaultStack, tiny_model: Path
) -> None:
    worker = WorkerProcess(
        stack_env(fault_stack.stores, tiny_model, MODEL), fault_stack.logs / "r13.log"
    ).start()
    fault_stack.workers.append(worker)
    assert worker.proc is not None
    engine = {p.pid: " ".join(p.cmdline()) for p in psutil.Process(worker.proc.pid).children(recursive=True)}
    assert any("EngineCore" in name for name in engine.values()), engine
    os.kill(worker.proc.pid, signal.SIGKILL)  # the main process only, not its process group
    worker.proc.wait()
    left = gone_within(engine, 10)
    for pid in left:  # a failed run must not leave them behind either
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert not left, f"engine processes alive 10 s after the worker's kill -9: {left}"


def test_r14_a_killed_workers_jobs_run_again_within_10_s(fault_stack: FaultStack) -> None:
    """Not after their leases (30 s here, as by default): as soon as the worker's presence
    lapses, the other worker's sweeper hands its running jobs on (default intervals). The
    dead worker dies holding the feeder's and the sweeper's locks, as it does when killed in
    the middle of their rounds (CI once saw that: the lines, released, waited for the
    feeder's 20 s lock); the other worker takes them over."""
    defaults = {
        "LLMQ_LEASE_SECONDS": "30",
        "LLMQ_SWEEPER_INTERVAL_SECONDS": "5",
        "LLMQ_REQUEUE_GRACE_SECONDS": "30",
        "LLMQ_BATCH_CHUNK_SIZE": "2",
    }
    doomed = fault_stack.worker("r14-a", **defaults)
    fault_stack.worker("r14-b", **defaults)
    assert doomed.proc is not None
    doomed_name = f"llmq-{doomed.proc.pid}@"
    batch = fault_stack.batch(16, max_tokens=1500)  # 15 s a line: none ends before the kill

    def lines(where: str) -> dict[str, tuple[str, str | None, int]]:
        with fault_stack.services.db.session() as s:
            result = s.execute(
                text(f"SELECT id, status, lease_owner, epoch FROM jobs WHERE batch_id = :b AND {where}"),
                {"b": batch},
            )
            return {r.id: (r.status, r.lease_owner, r.epoch) for r in result}

    deadline = time.monotonic() + 30
    while not (taken := lines(f"status = 'running' AND lease_owner LIKE '{doomed_name}%'")):
        assert time.monotonic() < deadline, fault_stack.describe(batch)
        time.sleep(0.1)
    doomed.kill(signal.SIGKILL)
    killed = time.monotonic()
    owner = next(iter(taken.values()))[1]
    for lock in ("batches", "sweeper"):
        fault_stack.services.redis.set(f"llmq:leader:{lock}", str(owner), px=20_000)
    while True:
        now = lines("TRUE")
        moved = {j for j in taken if now[j][0] != "queued" and not (now[j][1] or "").startswith(doomed_name)}
        if moved == set(taken):
            break
        assert time.monotonic() - killed < 10, f"still with the dead worker or queued: {set(taken) - moved}"
        time.sleep(0.1)
    assert all(now[j][2] >= 2 for j in taken)  # claimed again, under a new epoch
    done = fault_stack.wait_batch(batch, timeout=90)
    assert done["status"] == "completed" and done["request_counts"]["completed"] == 16
    fault_stack.inv(batch, 16)


def test_x8_a_constraint_that_kills_the_engine_fails_alone(fault_stack: FaultStack) -> None:
    """A constraint that passes every check yet kills the engine (as a compiler segfault in
    vLLM's engine core would): the poison line fails alone at once, attempts 1; the lines
    running beside it are handed back and succeed on the restarted worker."""
    poison = {"guided_choice": ["yes", ENGINE_CRASH_CHOICE]}
    batch = fault_stack.batch(24, max_tokens=40, fields={5: poison})
    deadline = time.monotonic() + 180
    while fault_stack.get_batch(batch)["status"] not in ("completed", "failed"):
        assert time.monotonic() < deadline, fault_stack.describe(batch)
        alive = [w for w in fault_stack.workers if w.proc is not None and w.proc.poll() is None]
        if not alive:  # the worker leaves when its engine dies; a supervisor starts another
            with contextlib.suppress(RuntimeError):
                fault_stack.worker(f"x8-{len(fault_stack.workers)}")
        time.sleep(0.5)
    assert any("engine is dead" in log_text(w) for w in fault_stack.workers), "the engine never died"
    done = fault_stack.get_batch(batch)
    assert done["request_counts"] == {"total": 24, "completed": 23, "failed": 1}
    (row,) = fault_stack.rows(batch, "custom_id = 'line-5'").values()
    assert row["status"] == "failed" and row["attempts"] == 1
    assert row["error"]["error"]["code"] == "constraint_suspected"
    assert row["error"]["error"]["param"] == "guided_choice"
    fault_stack.inv(batch, 24)
