"""B4 ingest: seconds to upload, check and store a 50,000-line JSONL file, against
`json.loads` of every line plus a raw Postgres COPY of the same rows in the same run
(goal: ≥ 0.5 of the baseline's rate); and the API process's peak memory growth while it
takes a ~190 MB file (goal: < 100 MB).

The service serves a real model (the tiny test model by default), so the API holds its
tokenizer as `llmq up`'s does. The goal's figure is an upload by a tenant with no batch
token budget (the default); the same file uploaded once the tenant has one, when each
line's prompt is counted with the tokenizer, is reported beside it (`budgeted_s`)."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import psycopg

from app.cli.client import LlmqClient
from app.cli.stack import Stack
from app.connections import ADMIN_POOL
from app.db import Database, normalize_url
from app.services.keys import KeyService
from bench import cpu
from bench.common import save, service, submit_all, wait_done

SERVED = "bench-b4"


def write_file(path: Path, lines: int, content_chars: int, *, model: str = SERVED) -> int:
    filler = "lorem ipsum " * (content_chars // 12 + 1)
    with path.open("w") as f:
        for i in range(lines):
            body = {
                "model": model,
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": f"{i} {filler[:content_chars]}"},
                ],
                "max_tokens": 16,
                "temperature": 0.7,
            }
            f.write(
                json.dumps(
                    {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
                )
                + "\n"
            )
    return path.stat().st_size


def baseline(path: Path, database_url: str) -> float:
    """json.loads of every line + COPY of (file_id, line_no, custom_id, raw) rows."""
    url = normalize_url(database_url).replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(url) as conn:
        conn.execute("CREATE TEMP TABLE b4_lines (file_id text, line_no int, custom_id text, raw text)")
        started = time.perf_counter()
        with (
            conn.cursor().copy("COPY b4_lines (file_id, line_no, custom_id, raw) FROM STDIN") as copy,
            path.open("rb") as f,
        ):
            for n, raw in enumerate(f, start=1):
                obj = json.loads(raw)
                copy.write_row(("file_baseline", n, obj["custom_id"], raw.decode().rstrip("\n")))
        conn.commit()
        return time.perf_counter() - started


def set_budget(stack: Stack, tokens: int) -> None:
    """The bench key's tenant gets a batch token budget, as `llmq tenants set NAME
    --batch-token-budget` gives it (the same KeyService call)."""
    db = Database.from_url(stack.env["LLMQ_DATABASE_URL"], ADMIN_POOL)
    try:
        KeyService(db).set_batch_token_budget(stack.settings.default_tenant, tokens)
    finally:
        db.dispose()


def api_workers(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children()


def hwm(proc: psutil.Process) -> int:
    for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def run(model: str = ".test-models/tiny", lines: int = 50_000, big_lines: int = 45_000) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp())
    small = tmp / "b4-50k.jsonl"
    size = write_file(small, lines, 120)
    big = tmp / "b4-190mb.jsonl"
    big_size = write_file(big, big_lines, 4_150)
    with service(model, SERVED, LLMQ_API_WORKERS="1") as stack:
        # Not measured: the API loads the model's tokenizer on its first request.
        warm = {"model": SERVED, "messages": [{"role": "user", "content": "warm"}], "max_tokens": 1}
        wait_done(stack, submit_all(stack, [warm]))
        client = LlmqClient(stack.base_url, stack.api_key, timeout=900)
        base_s = baseline(small, stack.env["LLMQ_DATABASE_URL"])
        with cpu.measure(stack) as use:
            started = time.perf_counter()
            client.upload_batch_file(small)
            llmq_s = time.perf_counter() - started
        workers = api_workers(stack.procs["api"].pid)
        rss_before = {w.pid: w.memory_info().rss for w in workers}
        started = time.perf_counter()
        client.upload_batch_file(big)
        big_s = time.perf_counter() - started
        growth = max(hwm(w) - rss_before[w.pid] for w in workers)
        set_budget(stack, 10**12)
        started = time.perf_counter()
        client.upload_batch_file(small)
        budgeted_s = time.perf_counter() - started
        client.close()
    result = {
        "id": "B4",
        "lines": lines,
        "file_mb": round(size / 1e6, 1),
        "baseline_s": round(base_s, 2),
        "llmq_s": round(llmq_s, 2),
        "ratio": round(base_s / llmq_s, 3),
        "budgeted_s": round(budgeted_s, 2),
        "budgeted_ratio": round(base_s / budgeted_s, 3),
        "big_file_mb": round(big_size / 1e6, 1),
        "big_upload_s": round(big_s, 1),
        "peak_rss_growth_mb": round(growth / 2**20, 1),
        "cpu_ms_per_line": use.per_unit_ms(lines),
        "goal": "ratio >= 0.5; peak RSS growth < 100 MB",
    }
    save("b4", result)
    print(json.dumps(result, indent=2))
    return result
