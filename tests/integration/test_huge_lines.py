"""A batch line of tens of MB fails alone, cheaply (issue 9 item 5, RELIABILITY X11).

A 20 MB line grew the worker from 1.15 to 4.5 GB before its context-length 400, and a
40 MB one rendered past its lease and was rendered three times at once. Now a line over
LLMQ_MAX_REQUEST_BYTES fails as a 400-type line error before the worker parses or renders
it (the claim does not even read it), on its first attempt; the other lines succeed.
"""

from __future__ import annotations

import io
import json
import threading
import time

import openai
import psutil
import pytest
from sqlalchemy import text

from tests.helpers import Stack, lines, sdk, wait_batch

pytestmark = pytest.mark.integration

HUGE = 20 * 1024 * 1024


def test_a_20_mb_line_fails_alone_and_the_worker_stays_small(stack: Stack, services) -> None:
    client: openai.OpenAI = sdk(stack)
    body = lines(stack.model, 6).splitlines()
    huge = json.loads(body[2])
    huge["body"]["messages"][0]["content"] = "word " * (HUGE // 5)
    body[2] = json.dumps(huge).encode()
    data = b"\n".join(body) + b"\n"
    assert len(data) > HUGE
    uploaded = client.files.create(file=("huge.jsonl", io.BytesIO(data)), purpose="batch")

    assert stack.worker.proc is not None
    worker = psutil.Process(stack.worker.proc.pid)
    baseline = peak = worker.memory_info().rss
    done_sampling = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done_sampling.is_set():
            peak = max(peak, worker.memory_info().rss)
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        done = wait_batch(client, batch.id, timeout=300)
    finally:
        done_sampling.set()
        sampler.join(5)

    assert done.status == "completed", done
    assert done.request_counts and (done.request_counts.completed, done.request_counts.failed) == (5, 1)
    assert done.error_file_id and done.output_file_id
    errors = [json.loads(x) for x in client.files.content(done.error_file_id).text.splitlines()]
    assert [e["custom_id"] for e in errors] == ["line-2"]
    assert errors[0]["response"]["status_code"] == 400
    assert errors[0]["response"]["body"]["error"]["code"] == "request_too_large"
    output = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    assert [o["custom_id"] for o in output] == [f"line-{i}" for i in range(6) if i != 2]
    with services.db.session() as s:
        attempts = s.execute(
            text("SELECT attempts FROM jobs WHERE batch_id = :b AND custom_id = 'line-2'"), {"b": batch.id}
        ).scalar_one()
    assert attempts == 1
    grown = peak - baseline
    print(f"worker rss {baseline / 2**20:.0f} MiB, peak {peak / 2**20:.0f} MiB (+{grown / 2**20:.0f} MiB)")
    assert grown < 2**30
