"""`kill -9` of `llmq up`: every process it started (Postgres, Redis, the API, the worker)
dies with it, so nothing is left holding the port, the stores or the engine."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil
import pytest

from app.cli.embedded import free_port, port_free
from tests.helpers import gone_within as _gone_within

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def test_kill_9_of_llmq_up_takes_every_child_with_it(tmp_path: Path) -> None:
    data = Path(tempfile.mkdtemp(prefix="llmq-up-"))
    data.chmod(0o755)  # embedded Postgres runs as an unprivileged user when we are root
    port = free_port(18700 + secrets.randbelow(200))
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMQ_")}
    env.update(
        {
            "LLMQ_ENGINE": "instant",
            "LLMQ_MODEL": "faulty",
            "LLMQ_API_WORKERS": "1",
            "LLMQ_EMBEDDED_PG_PORT": str(free_port(57700 + secrets.randbelow(200))),
            "LLMQ_EMBEDDED_REDIS_PORT": str(free_port(58700 + secrets.randbelow(200))),
            "LLMQ_WORKER_HEARTBEAT_SECONDS": "1",
            "PYTHONPATH": str(ROOT),
        }
    )
    with open(tmp_path / "up.log", "wb") as log:
        up = subprocess.Popen(
            [sys.executable, "-m", "app.cli.main", "up", "--port", str(port), "--data-dir", str(data)],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    children: dict[int, str] = {}
    try:
        deadline = time.monotonic() + 180
        while True:
            assert up.poll() is None, (tmp_path / "up.log").read_text()
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, (tmp_path / "up.log").read_text()
            time.sleep(0.5)
        children = {p.pid: " ".join(p.cmdline()) for p in psutil.Process(up.pid).children(recursive=True)}
        names = " ".join(children.values())
        assert "postgres" in names and "redis" in names and "gunicorn" in names and "worker" in names

        up.kill()
        up.wait()
        left = _gone_within(children, 10)
        assert not left, f"alive 10 s after `llmq up` was killed: {left}"
        assert port_free(port)
    finally:
        for pid in _gone_within(children, 0):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(up.pid, signal.SIGKILL)
        shutil.rmtree(data, ignore_errors=True)
