"""B8 fairness: tenant A creates a 20,000-line batch; 10 s later tenant B creates a
200-line batch. Goal: B's batch finishes within 3× the time it takes alone on the idle
service (a fair share gives it about half the engine), and A's total time grows by under
5 % over A alone. Baselines (A alone, B alone) are measured in the same run, on the same
service."""

from __future__ import annotations

import time
from typing import Any

from app.cli.client import LlmqClient
from bench.common import save
from bench.scheduling import TimedBatch, batch_file, scheduling_service, tenant_key


def run(big: int = 20_000, small: int = 200, delay: float = 10.0) -> dict[str, Any]:
    with scheduling_service() as stack:
        a = LlmqClient(stack.base_url, tenant_key(stack, "bench-tenant-a"), timeout=600)
        b = LlmqClient(stack.base_url, tenant_key(stack, "bench-tenant-b"), timeout=600)
        big_file, small_file = batch_file(big, "a"), batch_file(small, "b")
        b_alone = TimedBatch(b, small_file, "24h")
        b_alone.run()
        a_alone = TimedBatch(a, big_file, "24h")
        a_alone.run()
        a_shared, b_shared = TimedBatch(a, big_file, "24h"), TimedBatch(b, small_file, "24h")
        threads = [a_shared.start()]
        time.sleep(delay)
        threads.append(b_shared.start())
        for thread in threads:
            thread.join()
        a.close()
        b.close()
    assert a_alone.seconds and a_shared.seconds and b_alone.seconds and b_shared.seconds
    b_ratio = b_shared.seconds / b_alone.seconds
    a_growth = a_shared.seconds / a_alone.seconds - 1
    result = {
        "id": "B8",
        "b_alone_s": b_alone.seconds,
        "b_with_a_s": b_shared.seconds,
        "b_ratio": round(b_ratio, 2),
        "a_alone_s": a_alone.seconds,
        "a_with_b_s": a_shared.seconds,
        "a_growth_pct": round(a_growth * 100, 1),
        "ok": b_ratio <= 3 and a_growth < 0.05,
        "goal": "B <= 3x alone; A grows < 5 %",
    }
    save("b8", result)
    return result
