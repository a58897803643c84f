"""The real stack for integration tests: a Celery worker process running vLLM (CPU) on
the tiny model, and the API under gunicorn, against the session's Postgres and Redis."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis

from app.cli.embedded import free_port
from app.schemas.completion import ChatCompletion
from app.schemas.jobs import JobObject
from app.serve import gunicorn_argv
from app.services.health import live_workers
from tests.conftest import ROOT, Stores

TINY_DIR = ROOT / ".test-models" / "tiny"
E2E_MODEL = "tiny"


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    if not (TINY_DIR / "config.json").exists():
        subprocess.run(
            [sys.executable, "-m", "app.cli.main", "model", "build-tiny", str(TINY_DIR)], check=True, cwd=ROOT
        )
    return TINY_DIR


def stack_env(stores: Stores, model: Path, served_name: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMQ_")}
    env.update(
        {
            "LLMQ_DATABASE_URL": stores.database_url,
            "LLMQ_REDIS_URL": stores.redis_url,
            "LLMQ_MODEL": str(model),
            "LLMQ_SERVED_MODEL_NAME": served_name,
            "LLMQ_MAX_NUM_SEQS": "32",
            "LLMQ_KV_CACHE_SPACE_GIB": "1",
            "LLMQ_LEASE_SECONDS": "6",
            "LLMQ_SWEEPER_INTERVAL_SECONDS": "1",
            "LLMQ_REQUEUE_GRACE_SECONDS": "5",
            "LLMQ_WORKER_HEARTBEAT_SECONDS": "1",
            "LLMQ_SHUTDOWN_GRACE_SECONDS": "3",
            # Tests poll hard; the limiter has its own tests (tests/api/test_limits.py).
            "LLMQ_RATE_LIMIT_PER_MINUTE": "0",
            "PYTHONUNBUFFERED": "1",
            **extra,
        }
    )
    return env


class WorkerProcess:
    """`python -m worker` as a child; ready once it shows in the registry as consuming."""

    def __init__(self, env: dict[str, str], log_path: Path, *, module: str = "worker") -> None:
        self.env = env
        self.log_path = log_path
        self.module = module  # a test may run the worker through a launcher of its own
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 240) -> WorkerProcess:
        log = open(self.log_path, "ab")  # noqa: SIM115 - closed with the process
        self.proc = subprocess.Popen(
            [sys.executable, "-m", self.module],
            env=self.env,
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        r = redis.Redis.from_url(self.env["LLMQ_REDIS_URL"])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited with {self.proc.returncode}; see {self.log_path}")
            names = [
                w.get("name", "")
                for w in live_workers(r)
                if w.get("model") == self.env["LLMQ_SERVED_MODEL_NAME"]
            ]
            if any(n.startswith(f"llmq-{self.proc.pid}@") for n in names):
                return self
            time.sleep(0.5)
        raise TimeoutError(f"worker not consuming after {timeout}s; see {self.log_path}")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the worker and its engine processes (its whole session)."""
        assert self.proc is not None
        os.killpg(self.proc.pid, sig)
        self.proc.wait(60)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


class ApiProcess:
    def __init__(self, env: dict[str, str], log_path: Path) -> None:
        self.port = free_port(18500)
        self.url = f"http://127.0.0.1:{self.port}"
        log = open(log_path, "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            gunicorn_argv("127.0.0.1", self.port),
            env=env,
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        raise TimeoutError(f"API did not start; see {log_path}")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(30)


@dataclass
class Stack:
    url: str
    key: str
    model: str
    worker: WorkerProcess
    env: dict[str, str]

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.key}"}, timeout=60)


@pytest.fixture(scope="session")
def logs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = Path(os.environ.get("LLMQ_TEST_LOGS", str(tmp_path_factory.mktemp("logs"))))
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def stack(stores: Stores, tiny_model: Path, logs_dir: Path, services) -> Iterator[Stack]:
    env = stack_env(stores, tiny_model, E2E_MODEL, LLMQ_ALLOW_CUSTOM_CHAT_TEMPLATE="true")
    worker = WorkerProcess(env, logs_dir / "worker.log").start()
    api = ApiProcess(env, logs_dir / "api.log")
    key = services.keys.create_key("tenant-e2e")
    try:
        yield Stack(api.url, key, E2E_MODEL, worker, env)
    finally:
        api.stop()
        worker.stop()


def wait_for(client: httpx.Client, job_ids: list[str], timeout: float = 120) -> dict[str, dict]:
    """Poll until every job is terminal; returns the job objects by id."""
    done: dict[str, dict] = {}
    deadline = time.monotonic() + timeout
    while len(done) < len(job_ids):
        if time.monotonic() > deadline:
            pending = {j: client.get(f"/v2/jobs/{j}").json()["status"] for j in job_ids if j not in done}
            raise TimeoutError(f"jobs not finished: {pending}")
        for job_id in job_ids:
            if job_id not in done:
                job = client.get(f"/v2/jobs/{job_id}").json()
                if job["status"] in ("succeeded", "failed", "cancelled", "expired"):
                    # Every job the suite sees is held to the seed shapes.
                    JobObject.model_validate(job)
                    if job["response"] is not None:
                        ChatCompletion.model_validate(job["response"])
                    done[job_id] = job
        time.sleep(0.2)
    return done


def submit_unchecked(services, stack: Stack, body: dict) -> str:  # type: ignore[no-untyped-def]
    """Queue a job past the API's checks (as a batch line is), so the worker's own checks
    are what meets it."""
    from app.schemas.chat import ChatCompletionV2Request

    principal = services.keys.authenticate(stack.key)
    return str(services.jobs.submit_request(principal, ChatCompletionV2Request.model_validate(body)).id)
