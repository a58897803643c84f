"""Results while running (issue 13, must hold): while a 1,000-line batch runs on a real
worker (the instant engine, slowed per token so the batch takes seconds), the API under
gunicorn answers `/v1/batches/<id>/results` with a growing prefix of the ended lines, a
follower (`llmq batch tail`'s client) receives every line once as it ends, and the final
content equals the output and error files' lines, byte for byte."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.cli.batch import tail
from app.cli.client import LlmqClient
from app.cli.embedded import free_port, redis_start
from app.connections import ADMIN_POOL
from app.db import Database
from app.services.keys import KeyService
from tests.helpers import ROOT, ApiProcess, Stores, WorkerProcess, fresh_database, lines, stack_env

pytestmark = pytest.mark.integration

MODEL = "results-instant"
N = 1000
TERMINAL = {"completed", "failed", "expired", "cancelled"}


def test_results_are_a_growing_prefix_that_ends_equal_to_the_files(stores: Stores, logs_dir: Path) -> None:
    data = Path(tempfile.mkdtemp(prefix="llmq-results-"))
    port = free_port(56600)
    redis_server = redis_start(data, port, persistent=False)
    # Its own database and Redis: the session's workers would count this one as gone.
    own = Stores(fresh_database(stores), f"redis://127.0.0.1:{port}/0")
    env = stack_env(
        own,
        Path(MODEL),
        MODEL,
        LLMQ_ENGINE="instant",
        LLMQ_INSTANT_TOKEN_SECONDS="0.03",
        LLMQ_BATCH_TICK_SECONDS="0.1",
        LLMQ_BATCH_CHUNK_SIZE="16",
        LLMQ_BATCH_DISPATCH_WINDOW="64",
        LLMQ_RESULTS_POLL_SECONDS="0.2",
    )
    env["LLMQ_MODEL"] = MODEL
    worker = WorkerProcess(env, logs_dir / "results-worker.log").start(timeout=120)
    api = ApiProcess(env, logs_dir / "results-api.log")
    own_db = Database.from_url(own.database_url, ADMIN_POOL)
    key = KeyService(own_db).create_key("tenant-results")
    own_db.dispose()
    http = httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {key}"}, timeout=60)
    try:
        # One line in ten asks for more tokens than the context holds: it fails, in the error file.
        poison = set(range(7, N, 10))
        upload = http.post(
            "/v1/files",
            data={"purpose": "batch"},
            files={"file": ("in.jsonl", lines(MODEL, N, max_tokens=16, poison=poison))},
        )
        assert upload.status_code == 200, upload.text
        created = http.post(
            "/v1/batches",
            json={
                "input_file_id": upload.json()["id"],
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
            },
        )
        assert created.status_code == 200, created.text
        batch_id = created.json()["id"]

        # A follower from the start, through the CLI's own client and printer.
        followed = io.StringIO()
        follower_batch: dict[str, Any] = {}

        def follow() -> None:
            ended = tail(LlmqClient(api.url, key), batch_id, out=followed)
            follower_batch.update(ended or {})

        follower = threading.Thread(target=follow, daemon=True)
        follower.start()

        snapshots: list[list[bytes]] = []
        gathered: list[bytes] = []  # read with after=, what a polling client keeps
        cursor: str | None = None
        deadline = time.monotonic() + 300
        while True:
            assert time.monotonic() < deadline, "the batch did not end"
            whole = http.get(f"/v1/batches/{batch_id}/results")
            assert whole.status_code == 200 and whole.headers["content-type"].startswith("application/jsonl")
            snapshot = whole.content.splitlines(keepends=True)
            if snapshots:
                previous = snapshots[-1]
                assert snapshot[: len(previous)] == previous, "each answer extends the one before"
            snapshots.append(snapshot)
            newer = http.get(f"/v1/batches/{batch_id}/results", params={"after": cursor} if cursor else {})
            gathered += newer.content.splitlines(keepends=True)
            cursor = newer.headers.get("X-Llmq-Cursor", cursor)
            statuses = {whole.headers["X-Llmq-Batch-Status"], newer.headers["X-Llmq-Batch-Status"]}
            if statuses <= TERMINAL:
                break
            time.sleep(0.3)

        batch = http.get(f"/v1/batches/{batch_id}").json()
        assert batch["status"] == "completed", batch
        while_running = {len(s) for s in snapshots[:-1] if 0 < len(s) < N}
        assert len(while_running) >= 3, f"results grew while the batch ran: sizes {sorted(while_running)}"
        print(f"results sizes while running: {[len(x) for x in snapshots]}")

        final = snapshots[-1]
        files: list[bytes] = []
        for field in ("output_file_id", "error_file_id"):
            files += http.get(f"/v1/files/{batch[field]}/content").content.splitlines(keepends=True)
        assert len(final) == N and sorted(final) == sorted(files)
        custom_ids = [json.loads(x)["custom_id"] for x in final]
        assert len(set(custom_ids)) == N
        errors = [json.loads(x) for x in final if json.loads(x)["custom_id"] in {f"line-{i}" for i in poison}]
        assert len(errors) == len(poison) and all(e["response"]["status_code"] == 400 for e in errors)
        assert gathered == final, "reading with after= gathers the same lines, each once"

        follower.join(60)
        assert not follower.is_alive() and follower_batch.get("status") == "completed"
        assert [json.loads(x) for x in followed.getvalue().splitlines()] == [json.loads(x) for x in final]

        # `llmq batch tail` of an ended batch prints everything and exits 0.
        cli = subprocess.run(
            [sys.executable, "-m", "app.cli.main", "batch", "tail", batch_id, "--url", api.url, "--key", key],
            cwd=ROOT,
            capture_output=True,
            timeout=120,
            check=False,
        )
        assert cli.returncode == 0, cli.stderr
        assert [json.loads(x) for x in cli.stdout.splitlines()] == [json.loads(x) for x in final]
        assert b"completed" in cli.stderr
        resumed = subprocess.run(
            [
                sys.executable,
                "-m",
                "app.cli.main",
                "batch",
                "tail",
                batch_id,
                "--after",
                str(cursor),
                "--url",
                api.url,
                "--key",
                key,
            ],
            cwd=ROOT,
            capture_output=True,
            timeout=120,
            check=False,
        )
        assert resumed.returncode == 0 and resumed.stdout == b"", resumed.stderr
    finally:
        http.close()
        api.stop()
        worker.stop()
        redis_server.stop()
