"""`llmq worker health` against the real Redis: the compose healthcheck's command, end to end.
This test process stands in for the worker: its pid and host name are what a worker of this
host registers under."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import redis

from app.services.health import register_worker, unregister_worker
from tests.helpers import ROOT, Stores


def _health(stores: Stores) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMQ_")}
    env["LLMQ_REDIS_URL"] = stores.redis_url
    return subprocess.run(
        [sys.executable, "-m", "app.cli.main", "worker", "health"],
        check=False,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_health_follows_this_hosts_registration(stores: Stores) -> None:
    client: redis.Redis[bytes] = redis.Redis.from_url(stores.redis_url)
    name = f"llmq-{os.getpid()}@{socket.gethostname()}"
    info = {"name": name, "model": "m", "engine": "ok", "inflight": 0, "capacity": 8}
    try:
        register_worker(client, name, {**info, "pid": os.getpid(), "consuming": True}, ttl_seconds=30)
        healthy = _health(stores)
        assert healthy.returncode == 0, healthy.stderr
        assert f"{name} is consuming" in healthy.stdout
    finally:
        unregister_worker(client, name)
    gone = _health(stores)
    assert gone.returncode == 1
    assert f"no worker of host {socket.gethostname()!r}" in gone.stderr
