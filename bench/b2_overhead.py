"""B2 per-line overhead: jobs per second through the whole service with an engine that
answers at once (`LLMQ_ENGINE=instant`), so what is measured is llmq itself: insert,
enqueue, claim, run, save. Goal: ≤ 0.2 ms of service time per line (≥ 5,000 lines/s).

Until bulk batches exist, the jobs are inserted set-based straight into Postgres and
enqueued, as a batch will be; the worker's per-job path is the one measured."""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import insert

from app.container import build_services
from app.ids import new_id
from app.models import Job
from app.settings import Settings
from bench.common import save, service, wait_done


def run(lines: int = 10_000) -> dict[str, Any]:
    served = "bench-b2"
    with service("instant", served, LLMQ_ENGINE="instant", LLMQ_MAX_NUM_SEQS="64") as stack:
        settings = Settings(
            database_url=stack.env["LLMQ_DATABASE_URL"], redis_url=stack.env["LLMQ_REDIS_URL"], model=served
        )
        svc = build_services(settings)
        tenant = svc.keys.ensure_tenant("bench")
        request = {"model": served, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
        rows = [
            {
                "id": new_id("job"),
                "tenant_id": tenant,
                "model": served,
                "request": request,
                "status": "queued",
            }
            for _ in range(lines)
        ]
        start = time.perf_counter()
        with svc.db.session() as s:
            s.execute(insert(Job), rows)
        for row in rows:
            svc.queue.enqueue(row["id"], served, 0, batch_line=True)
        enqueue_s = time.perf_counter() - start
        done = wait_done(stack, [r["id"] for r in rows])
        total = time.perf_counter() - start
        svc.close()
    per_line_ms = total / lines * 1e3
    result = {
        "id": "B2",
        "lines": lines,
        "succeeded": int(done["ok"]),
        "insert_and_enqueue_s": round(enqueue_s, 2),
        "total_s": round(total, 2),
        "lines_per_s": round(lines / total, 1),
        "ms_per_line": round(per_line_ms, 3),
        "goal": "<= 0.2 ms/line (>= 5,000 lines/s)",
    }
    save("b2", result)
    return result
