"""B2 per-line overhead: a 10,000-line batch through the whole service (upload, batch,
feeder, broker, worker chunks, Postgres) with an engine that answers at once
(`LLMQ_ENGINE=instant`), so what is measured is llmq itself.
Goal: ≤ 0.2 ms of service time per line (≥ 5,000 lines/s).

Three sizes show whether the cost per line stays flat as batches grow."""

from __future__ import annotations

import json
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from app.cli.client import LlmqClient
from app.cli.stack import Stack
from bench import cpu
from bench.common import save, service

SERVED = "bench-b2"


def write_batch(path: Path, lines: int) -> None:
    with path.open("w") as f:
        for i in range(lines):
            body = {"model": SERVED, "messages": [{"role": "user", "content": f"line {i}"}], "max_tokens": 1}
            f.write(
                json.dumps(
                    {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
                )
                + "\n"
            )


def one(client: LlmqClient, lines: int, stack: Stack | None = None) -> dict[str, Any]:
    path = Path(tempfile.mkdtemp()) / f"b2-{lines}.jsonl"
    write_batch(path, lines)
    started = time.perf_counter()
    uploaded = client.upload_batch_file(path)
    with cpu.measure(stack) if stack is not None else nullcontext(cpu.CpuUse()) as use:
        batch = client.create_batch(uploaded["id"], window="1h")
        created = time.perf_counter()
        while batch["status"] not in ("completed", "failed", "expired", "cancelled"):
            time.sleep(0.2)
            batch = client.get_batch(batch["id"])
        finished = time.perf_counter()
    run_s = batch["completed_at"] - batch["in_progress_at"] if batch["completed_at"] else finished - created
    run_s = max(run_s, finished - created - 1.0)  # server timestamps are whole seconds
    return {
        "lines": lines,
        "completed": batch["request_counts"]["completed"],
        "ingest_s": round(created - started, 2),
        "run_s": round(finished - created, 2),
        "lines_per_s": round(lines / (finished - created), 1),
        "ms_per_line": round((finished - created) / lines * 1e3, 3),
        "cpu_ms_per_line": use.per_unit_ms(lines),
        "worker_threads_ms_per_line": use.threads_per_unit_ms(lines),
    }


def run(sizes: tuple[int, ...] = (2_000, 10_000, 50_000)) -> dict[str, Any]:
    """The goal is read at 10,000 lines (the middle size); the others show the curve."""
    env = {
        "LLMQ_ENGINE": "instant",
        "LLMQ_MAX_NUM_SEQS": "64",
        "LLMQ_BATCH_DISPATCH_WINDOW": "2048",
        "LLMQ_BATCH_CHUNK_SIZE": "128",
    }
    with service("instant", SERVED, **env) as stack:
        client = LlmqClient(stack.base_url, stack.api_key, timeout=600)
        runs = [one(client, n, stack) for n in sizes]
        client.close()
    goal = next((r for r in runs if r["lines"] == 10_000), runs[-1])
    result = {
        "id": "B2",
        "runs": runs,
        "lines": goal["lines"],
        "lines_per_s": goal["lines_per_s"],
        "ms_per_line": goal["ms_per_line"],
        "ms_per_line_by_size": "/".join(str(r["ms_per_line"]) for r in runs),
        "cpu_ms_per_line": goal["cpu_ms_per_line"],
        "worker_threads_ms_per_line": goal["worker_threads_ms_per_line"],
        "goal": "<= 0.2 ms/line (>= 5,000 lines/s)",
    }
    save("b2", result)
    return result
