"""`llmq worker health`: healthy only while a worker process of this host is registered and
consuming; the registry is fakeredis, written the way the worker's heartbeat writes it."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import fakeredis
import pytest
from redis import Redis

from app.cli.worker_health import check, worker_names
from app.services.health import live_workers, register_worker
from tests.helpers import ROOT
from worker.control import RegistryHeartbeat


@pytest.fixture
def redis() -> Redis[bytes]:
    client: Redis[bytes] = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    return client


def _register(redis: Redis[bytes], name: str, pid: int, *, consuming: bool = True) -> None:
    info = {"name": name, "model": "m", "engine": "ok", "inflight": 0, "capacity": 8, "pid": pid}
    register_worker(redis, name, {**info, "consuming": consuming}, ttl_seconds=30)


def test_empty_registry_is_unhealthy_and_says_why(redis: Redis[bytes]) -> None:
    verdict = check(redis, "gpu0")
    assert not verdict.healthy
    assert "no worker of host 'gpu0'" in verdict.message


@pytest.mark.parametrize("name", sorted(worker_names("gpu0", 4242)))
def test_a_consuming_worker_of_this_host_is_healthy(redis: Redis[bytes], name: str) -> None:
    _register(redis, name, 4242)
    verdict = check(redis, "gpu0", running=lambda pid: pid == 4242)
    assert verdict.healthy, verdict.message
    assert name in verdict.message


def test_a_worker_of_another_host_does_not_count(redis: Redis[bytes]) -> None:
    _register(redis, "llmq-4242@gpu1", 4242)
    assert not check(redis, "gpu0", running=lambda _pid: True).healthy


def test_a_host_name_that_only_shares_a_prefix_does_not_count(redis: Redis[bytes]) -> None:
    _register(redis, "llmq-4242@gpu0-b", 4242)
    assert not check(redis, "gpu0", running=lambda _pid: True).healthy


def test_an_entry_whose_process_is_gone_is_unhealthy(redis: Redis[bytes]) -> None:
    """Left by the container's previous run, before its registration expired."""
    _register(redis, "llmq-4242@gpu0", 4242)
    verdict = check(redis, "gpu0", running=lambda _pid: False)
    assert not verdict.healthy
    assert "llmq-4242@gpu0 registered" in verdict.message


def test_a_registered_entry_that_is_not_consuming_is_unhealthy(redis: Redis[bytes]) -> None:
    _register(redis, "llmq-4242@gpu0", 4242, consuming=False)
    assert not check(redis, "gpu0", running=lambda _pid: True).healthy


def test_the_real_process_check_sees_this_process() -> None:
    from app.cli.worker_health import pid_running

    assert pid_running(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert not pid_running(child.pid)


def test_the_cli_exits_1_with_a_message_when_redis_is_unreachable() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMQ_")}
    env["LLMQ_REDIS_URL"] = "redis://127.0.0.1:9/0"
    done = subprocess.run(
        [sys.executable, "-m", "app.cli.main", "worker", "health"],
        check=False,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1, done
    assert "cannot read the worker registry" in done.stderr


def test_plain_llmq_worker_still_runs_the_worker() -> None:
    from app.cli.main import build_parser, cmd_worker

    args = build_parser().parse_args(["worker"])
    assert args.func is cmd_worker
    assert args.worker_command is None
    assert build_parser().parse_args(["worker", "health"]).worker_command == "health"


def test_the_heartbeat_registers_a_worker_when_its_consumer_is_ready_not_an_interval_later(
    redis: Redis[bytes],
) -> None:
    """Before Celery's consumer runs, its ping cannot be answered; a first round then would
    leave a new worker out of the registry (so out of the feeder's window) for a whole
    interval. Rounds never overlap: a slow, failed ping cannot undo a later success."""
    answers = iter([(0.3, False), (0.0, True)])

    def consuming() -> bool:
        pause, answer = next(answers)
        time.sleep(pause)
        return answer

    info = {"name": "w1", "model": "m", "engine": "ok", "inflight": 0, "capacity": 8}
    beat = RegistryHeartbeat(redis, "w1", lambda: dict(info), consuming, interval=60)
    beat.start()
    time.sleep(0.2)
    assert live_workers(redis) == []  # no round at start: the consumer is not up yet
    beat.kick()  # a round that started too early, its ping failing slowly
    time.sleep(0.05)
    beat.kick()  # worker_ready
    deadline = time.monotonic() + 5
    while not live_workers(redis):
        assert time.monotonic() < deadline, "not registered once the consumer was ready"
        time.sleep(0.02)
    time.sleep(0.5)
    assert [w["name"] for w in live_workers(redis)] == ["w1"]
    beat.stop()


def test_a_stopped_worker_runs_its_exit_handlers_and_exits_with_celerys_code(tmp_path) -> None:
    """`leave` skips the interpreter's teardown (seconds under load), not the exit handlers
    (captured output drained, spans flushed, temporary files removed)."""
    marker = tmp_path / "handler-ran"
    code = (
        "import atexit, pathlib, sys\n"
        f"atexit.register(lambda: pathlib.Path({str(marker)!r}).write_text('yes'))\n"
        "from worker.__main__ import leave\n"
        "print('flushed', end='')\n"
        "leave(3)\n"
    )
    argv = [sys.executable, "-c", code]
    done = subprocess.run(argv, check=False, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, done.stderr
    assert done.stdout == "flushed"
    assert marker.read_text() == "yes"
