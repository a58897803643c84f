"""A fault harness: the real stack as separate processes, with Postgres and Redis of its
own (embedded servers that a test may stop, kill or restart), workers that a test may kill,
pause or stop, and the API in process. Workers run the instant engine (slowed down per
token, so work is in flight when the fault lands) wherever the engine is not the subject.

Every scenario ends with INV (RELIABILITY.md): for a batch of n lines there are exactly n
job rows with distinct line numbers, the output and error files hold each custom_id
exactly once, and every finished row was written by the holder of its last claim.
"""

from __future__ import annotations

import contextlib
import io
import json
import secrets
import signal
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from flask.testing import FlaskClient
from sqlalchemy import text

from app.api import create_app
from app.cli.embedded import Server, free_port, pg_start, redis_start
from app.cli.stack import run_migrations
from app.container import Services, build_services
from app.settings import Settings
from tests.helpers import Stores, WorkerProcess, auth, stack_env
from tests.integration.conftest import tiny_model as tiny_model  # noqa: PLC0414 - a fixture, re-exported

MODEL = "faulty"
CRASHING_WORKER = "tests.faults.crashing_worker"  # the worker with a poison-prompt engine (R10)
TERMINAL = {"completed", "failed", "expired", "cancelled"}


@dataclass
class FaultStack:
    root: Path
    logs: Path
    pg_port: int
    redis_port: int
    pg: Server
    redis: Server
    services: Services
    client: FlaskClient
    key: str
    workers: list[WorkerProcess] = field(default_factory=list)

    @property
    def stores(self) -> Stores:
        return Stores(self.pg.url, self.redis.url)

    # --- processes --------------------------------------------------------------------

    def worker(self, name: str, **env: str) -> WorkerProcess:
        extra = {
            "LLMQ_ENGINE": "instant",
            "LLMQ_INSTANT_TOKEN_SECONDS": "0.01",
            "LLMQ_LEASE_SECONDS": "3",
            "LLMQ_SWEEPER_INTERVAL_SECONDS": "0.5",
            "LLMQ_REQUEUE_GRACE_SECONDS": "3",
            "LLMQ_BATCH_TICK_SECONDS": "0.1",
            "LLMQ_BATCH_CHUNK_SIZE": "16",
            "LLMQ_BATCH_DISPATCH_WINDOW": "64",
            **env,
        }
        process_env = stack_env(self.stores, Path(MODEL), MODEL, **extra)
        process_env["LLMQ_MODEL"] = MODEL
        worker = WorkerProcess(process_env, self.logs / f"{name}.log", module=CRASHING_WORKER).start(
            timeout=60
        )
        self.workers.append(worker)
        return worker

    def stop_pg(self) -> None:
        self.pg.stop()

    def start_pg(self) -> None:
        self.pg = pg_start(self.root / "pg", self.pg_port, "llmq")

    def stop_redis(self) -> None:
        self.redis.stop()

    def start_redis(self) -> None:
        self.redis = redis_start(self.root / "redis", self.redis_port, persistent=False)

    # --- work ---------------------------------------------------------------------------

    def batch(
        self,
        n: int,
        *,
        max_tokens: int = 20,
        special: dict[int, str] | None = None,
        fields: dict[int, dict[str, Any]] | None = None,
        model: str = MODEL,
    ) -> str:
        """`special`: a line's message text; `fields`: more body fields for a line."""
        lines = []
        for i in range(n):
            content = (special or {}).get(i, f"line {i}")
            body = {
                "model": model,
                "messages": [{"role": "user", "content": content}],
                "max_tokens": max_tokens,
                **(fields or {}).get(i, {}),
            }
            lines.append(
                json.dumps(
                    {"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
                )
            )
        data = ("\n".join(lines) + "\n").encode()
        f = self.client.post(
            "/v1/files",
            data={"purpose": "batch", "file": (io.BytesIO(data), "in.jsonl")},
            headers=auth(self.key),
            content_type="multipart/form-data",
        ).get_json()
        b = self.client.post(
            "/v1/batches",
            json={"input_file_id": f["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"},
            headers=auth(self.key),
        ).get_json()
        return str(b["id"])

    def get_batch(self, batch_id: str) -> dict[str, Any]:
        return dict(self.client.get(f"/v1/batches/{batch_id}", headers=auth(self.key)).get_json())

    def wait_batch(self, batch_id: str, timeout: float = 120) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                batch = self.get_batch(batch_id)
                if batch["status"] in TERMINAL:
                    return batch
            except Exception:
                pass
            assert time.monotonic() < deadline, f"batch {batch_id} not finished"
            time.sleep(0.3)

    def rows(self, batch_id: str, where: str = "TRUE") -> dict[str, Any]:
        with self.services.db.session() as s:
            result = s.execute(
                text(
                    "SELECT id, status, attempts, epoch, finished_by, succeeded_at, error "
                    f"FROM jobs WHERE batch_id = :b AND {where}"
                ),
                {"b": batch_id},
            ).mappings()
            return {r["id"]: dict(r) for r in result}

    def describe(self, batch_id: str) -> str:
        """Where a stuck batch's lines are, for a failure message: rows by state, and the
        broker's view (queue lengths, unacknowledged deliveries, markers)."""
        with self.services.db.session() as s:
            groups = s.execute(
                text(
                    "SELECT status, attempts, enqueued_at IS NULL AS unsent, count(*) FROM jobs "
                    "WHERE batch_id = :b GROUP BY 1, 2, 3 ORDER BY 1, 2, 3"
                ),
                {"b": batch_id},
            ).all()
        r = self.services.redis
        queues = {k.decode(): r.llen(k) for k in r.scan_iter("llmq.*") if r.type(k) == b"list"}
        markers = sum(1 for _ in r.scan_iter("llmq:sent:*"))
        leaders = {k.decode(): r.get(k) for k in r.scan_iter("llmq:leader:*")}
        return (
            f"rows (status, attempts, unsent, n): {[tuple(g) for g in groups]}; queues {queues}; "
            f"unacked {r.hlen('unacked')}; markers {markers}; leaders {leaders}; "
            f"logs {[w.log_path.name for w in self.workers]}"
        )

    def wait_rows(self, batch_id: str, where: str, count: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while len(self.rows(batch_id, where)) < count:
            assert time.monotonic() < deadline, f"never reached {count} rows where {where}"
            time.sleep(0.1)

    def inv(self, batch_id: str, n: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """INV, and the parsed output and error lines."""
        batch = self.get_batch(batch_id)
        files = []
        for field_name in ("output_file_id", "error_file_id"):
            fid = batch.get(field_name)
            content = self.client.get(f"/v1/files/{fid}/content", headers=auth(self.key)).data if fid else b""
            files.append([json.loads(x) for x in content.decode().splitlines()])
        output, errors = files
        with self.services.db.session() as s:
            count, distinct, unowned = s.execute(
                text(
                    "SELECT count(*), count(DISTINCT line_no), "
                    "count(*) FILTER (WHERE status = 'succeeded' AND finished_by IS NULL) "
                    "FROM jobs WHERE batch_id = :b"
                ),
                {"b": batch_id},
            ).one()
        assert (count, distinct) == (n, n)
        assert unowned == 0
        ids = [x["custom_id"] for x in output + errors]
        assert len(ids) == len(set(ids)) == n
        return output, errors


@pytest.fixture
def fault_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultStack]:
    root = Path(tempfile.mkdtemp(prefix="llmq-faults-"))
    root.chmod(0o755)
    logs = tmp_path_factory.mktemp("fault-logs")
    pg_port, redis_port = free_port(55700 + secrets.randbelow(200)), free_port(56700 + secrets.randbelow(200))
    pg = pg_start(root / "pg", pg_port, "llmq")
    redis = redis_start(root / "redis", redis_port, persistent=False)
    run_migrations(pg.url)
    settings = Settings(
        database_url=pg.url,
        redis_url=redis.url,
        model=MODEL,
        served_model_name=MODEL,
        rate_limit_per_minute=0,
        cancel_wait_seconds=1.0,
    )
    services = build_services(settings)
    stack = FaultStack(
        root=root,
        logs=logs,
        pg_port=pg_port,
        redis_port=redis_port,
        pg=pg,
        redis=redis,
        services=services,
        client=create_app(services=services).test_client(),
        key=services.keys.create_key("tenant-faults"),
    )
    try:
        yield stack
    finally:
        for worker in stack.workers:
            if worker.proc is not None and worker.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    worker.kill(signal.SIGKILL)
        services.close()
        stack.redis.stop()
        stack.pg.stop()
