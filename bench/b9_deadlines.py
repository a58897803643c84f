"""B9 deadlines: a 24 h batch of 5,000 lines is running; a 1 h batch of 500 lines is
created (same tenant, the case fair share does not help). Goal: the 1 h batch finishes
first."""

from __future__ import annotations

import time
from typing import Any

from app.cli.client import LlmqClient
from bench.common import save
from bench.scheduling import TimedBatch, batch_file, scheduling_service


def run(long: int = 5_000, short: int = 500, delay: float = 3.0) -> dict[str, Any]:
    with scheduling_service() as stack:
        client = LlmqClient(stack.base_url, stack.api_key, timeout=600)
        day = TimedBatch(client, batch_file(long, "day"), "24h")
        hour = TimedBatch(client, batch_file(short, "hour"), "1h")
        threads = [day.start()]
        time.sleep(delay)
        threads.append(hour.start())
        for thread in threads:
            thread.join()
        client.close()
    assert day.ended_at and hour.ended_at
    result = {
        "id": "B9",
        "day_batch_s": day.seconds,
        "hour_batch_s": hour.seconds,
        "hour_first_by_s": round(day.ended_at - hour.ended_at, 2),
        "ok": hour.ended_at < day.ended_at,
        "goal": "the 1 h batch finishes first",
    }
    save("b9", result)
    return result
