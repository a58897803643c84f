"""The real stack for integration tests: a Celery worker process running vLLM (CPU) on
the tiny model, and the API under gunicorn, against the session's Postgres and Redis."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import E2E_MODEL, ROOT, TINY_DIR, ApiProcess, Stack, Stores, WorkerProcess, stack_env


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    if not (TINY_DIR / "config.json").exists():
        subprocess.run(
            [sys.executable, "-m", "app.cli.main", "model", "build-tiny", str(TINY_DIR)], check=True, cwd=ROOT
        )
    return TINY_DIR


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
