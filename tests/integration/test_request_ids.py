"""Request ids end to end (issue 14, must hold): one request id appears in the HTTP response,
the API's access log, the job record and the worker's log lines for that job, for a queued
job and a sync chat, on a real worker (the instant engine) and the API under gunicorn, both
writing JSON logs."""

from __future__ import annotations

import json
import secrets
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.cli.embedded import free_port, redis_start
from app.connections import ADMIN_POOL
from app.db import Database
from app.services.keys import KeyService
from tests.helpers import ApiProcess, Stores, WorkerProcess, fresh_database, stack_env

pytestmark = pytest.mark.integration

MODEL = "reqid-instant"


def json_lines(path: Path) -> list[dict[str, Any]]:
    out = []
    for raw in path.read_text(errors="replace").splitlines():
        if raw.startswith("{"):
            try:
                out.append(json.loads(raw))
            except json.JSONDecodeError:
                continue
    return out


def wait_for(condition: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_one_request_id_in_the_response_the_access_log_the_job_and_the_workers_lines(
    stores: Stores, logs_dir: Path
) -> None:
    data = Path(tempfile.mkdtemp(prefix="llmq-reqid-"))
    port = free_port(56700)
    redis_server = redis_start(data, port, persistent=False)
    # Its own database and Redis: the session's workers would count this one as gone.
    own = Stores(fresh_database(stores), f"redis://127.0.0.1:{port}/0")
    env = stack_env(own, Path(MODEL), MODEL, LLMQ_ENGINE="instant", LLMQ_LOG_JSON="true")
    env["LLMQ_MODEL"] = MODEL
    worker_log, api_log = logs_dir / "reqid-worker.log", logs_dir / "reqid-api.log"
    worker = WorkerProcess(env, worker_log).start(timeout=120)
    api = ApiProcess(env, api_log)
    own_db = Database.from_url(own.database_url, ADMIN_POOL)
    key = KeyService(own_db).create_key("tenant-reqid")
    own_db.dispose()
    http = httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {key}"}, timeout=60)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    try:
        sent = f"e2e-{secrets.token_hex(6)}"
        r = http.post("/v2/jobs", json=body, headers={"X-Request-ID": sent})
        assert r.status_code == 202, r.text
        assert r.headers["X-Request-ID"] == sent
        job_id = r.json()["id"]
        done = wait_for(
            lambda: (j := http.get(f"/v2/jobs/{job_id}").json())["status"] == "succeeded" and j,
            60,
            "the job to succeed",
        )
        # A sync chat: no id sent, so the API made one.
        chat = http.post("/v1/chat/completions", json=body)
        assert chat.status_code == 200, chat.text
        made, chat_job = chat.headers["X-Request-ID"], chat.headers["X-Llmq-Job-Id"]
        assert made.startswith("req_") and made != sent
        chat_record = http.get(f"/v2/jobs/{chat_job}").json()

        def access_lines(rid: str) -> list[dict[str, Any]]:
            lines = [x for x in json_lines(api_log) if x.get("logger") == "llmq.access"]
            return [x for x in lines if x.get("request_id") == rid]

        def worker_lines(job: str) -> list[dict[str, Any]]:
            lines = [x for x in json_lines(worker_log) if x.get("job_id") == job]
            return lines if any(x.get("msg") == "job succeeded" for x in lines) else []

        for rid, job, record in [(sent, job_id, done), (made, chat_job, chat_record)]:
            assert record["request_id"] == rid
            (access,) = wait_for(lambda rid=rid: access_lines(rid), 10, f"the access line of {rid}")
            assert access["status"] in (200, 202) and access["tenant"] == "tenant-reqid"
            about = wait_for(lambda job=job: worker_lines(job), 10, f"the worker's lines for {job}")
            assert {"job claimed", "job succeeded"} <= {x["msg"] for x in about}
            assert all(x.get("request_id") == rid for x in about), about
        assert key not in api_log.read_text() and key not in worker_log.read_text()
    finally:
        http.close()
        api.stop()
        worker.stop()
        redis_server.stop()
