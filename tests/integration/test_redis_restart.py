"""Redis restarts (losing everything: no persistence) while a job streams: the job
completes, the stream's log is rebuilt by the worker, and a client that resumes with
Last-Event-ID gets the rest, the joined text equal to the stored result."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import httpx
import pytest

from app.cli.embedded import free_port, redis_start
from app.connections import ADMIN_POOL
from app.db import Database
from app.services.keys import KeyService
from tests.helpers import (
    ApiProcess,
    Event,
    Stores,
    WorkerProcess,
    events,
    fresh_database,
    make_settings,
    stack_env,
    text_of,
    wait_for,
)

pytestmark = pytest.mark.integration

MODEL = "tiny-redis-restart"


def test_redis_restart_mid_stream(stores: Stores, tiny_model: Path, logs_dir: Path) -> None:
    data = Path(tempfile.mkdtemp(prefix="llmq-s4-"))
    port = free_port(56500)
    redis_server = redis_start(data, port, persistent=False)
    # Its own database too: the session's worker, on the session's Redis, would count this
    # worker (present only in this Redis) as gone and take its job.
    own = Stores(fresh_database(stores), f"redis://127.0.0.1:{port}/0")
    env = stack_env(own, tiny_model, MODEL, LLMQ_SSE_HEARTBEAT_SECONDS="1")
    worker = WorkerProcess(env, logs_dir / "s4-worker.log").start()
    api = ApiProcess(env, logs_dir / "s4-api.log")
    own_db = Database.from_settings(make_settings(own), ADMIN_POOL)
    key = KeyService(own_db).create_key("tenant-s4")
    own_db.dispose()
    client = httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {key}"}, timeout=120)
    try:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "go"}],
            "max_tokens": 1900,
            "ignore_eos": True,
        }
        job_id = client.post("/v2/jobs", json=body).json()["id"]
        received: list[Event] = []
        with client.stream("GET", f"/v2/jobs/{job_id}/stream") as r:
            it = events(r)
            received += [next(it) for _ in range(3)]
        redis_server.stop()
        # Until the API sees the outage, not a fixed time.
        deadline = time.monotonic() + 30
        while client.get("/readyz").status_code == 200:
            assert time.monotonic() < deadline, "the outage was never seen by /readyz"
            time.sleep(0.1)
        redis_server = redis_start(data, port, persistent=False)
        # Resume until the end, reconnecting whenever the connection breaks.
        deadline = time.monotonic() + 180
        while not (received and received[-1].done):
            assert time.monotonic() < deadline, "stream did not finish"
            try:
                with client.stream(
                    "GET", f"/v2/jobs/{job_id}/stream", headers={"Last-Event-ID": received[-1].id or ""}
                ) as r:
                    if r.status_code != 200:
                        time.sleep(0.5)
                        continue
                    for event in events(r):
                        received.append(event)
            except httpx.HTTPError:
                time.sleep(0.5)
        job = wait_for(client, [job_id], timeout=120)[job_id]
        assert job["status"] == "succeeded"
        assert job["usage"]["completion_tokens"] == 1900
        ids = [e.id for e in received if e.id]
        assert len(ids) == len(set(ids)), "an event arrived twice"
        assert text_of(received) == job["response"]["choices"][0]["message"]["content"]
    finally:
        client.close()
        api.stop()
        worker.stop()
        redis_server.stop()
