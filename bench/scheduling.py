"""What B8 (fairness) and B9 (deadlines) share: a service on the simulated engine, batch
files, a second tenant's key, and timing a batch from creation to its end."""

from __future__ import annotations

import json
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from app.cli.client import LlmqClient
from app.cli.stack import Stack
from app.connections import ADMIN_POOL
from app.db import Database
from app.services.keys import KeyService
from bench.common import ROOT, service

SERVED = "bench-sched"
MAX_NUM_SEQS = 256
MAX_TOKENS = 16
# A decode step of 5 ms + 0.19 ms per running sequence: 256 sequences × 16 tokens take
# 16 × 53.6 ms, so one worker ends about 300 lines/s, well under what this 2-core box moves
# through the service (B2), so the schedule is what is measured, not the box.
ENGINE_ENV = {
    "LLMQ_ENGINE": "simulated",
    "LLMQ_MAX_NUM_SEQS": str(MAX_NUM_SEQS),
    "LLMQ_SIM_STEP_MS": "5",
    "LLMQ_SIM_STEP_MS_PER_SEQ": "0.19",
    "LLMQ_SIM_PREFILL_MS_PER_TOKEN": "0.002",
}
TERMINAL = ("completed", "failed", "expired", "cancelled")


@contextmanager
def scheduling_service() -> Iterator[Stack]:
    with service(str(ROOT / ".test-models" / "tiny"), SERVED, **ENGINE_ENV) as stack:
        yield stack


def tenant_key(stack: Stack, tenant: str) -> str:
    db = Database.from_url(stack.env["LLMQ_DATABASE_URL"], ADMIN_POOL)
    try:
        return KeyService(db).create_key(tenant)
    finally:
        db.dispose()


def batch_file(lines: int, tag: str) -> Path:
    path = Path(tempfile.mkdtemp(prefix="llmq-sched-")) / f"{tag}.jsonl"
    with path.open("w") as f:
        for i in range(lines):
            body = {
                "model": SERVED,
                "messages": [{"role": "user", "content": f"{tag} line {i}"}],
                "max_tokens": MAX_TOKENS,
            }
            line = {"custom_id": f"{tag}-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
            f.write(json.dumps(line) + "\n")
    return path


class TimedBatch:
    """One batch created from an uploaded file, timed from the create call to its end
    as the client sees it (polled every 0.1 s)."""

    def __init__(self, client: LlmqClient, path: Path, window: str) -> None:
        self._client = client
        self._file = client.upload_batch_file(path)["id"]
        self._window = window
        self.seconds: float | None = None
        self.ended_at: float | None = None
        self.batch: dict[str, Any] = {}

    def run(self) -> None:
        started = time.perf_counter()
        batch = self._client.create_batch(self._file, window=self._window)
        while batch["status"] not in TERMINAL:
            time.sleep(0.1)
            batch = self._client.get_batch(batch["id"])
        self.ended_at = time.perf_counter()
        self.seconds = round(self.ended_at - started, 2)
        self.batch = batch

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.run, daemon=True)
        thread.start()
        return thread
