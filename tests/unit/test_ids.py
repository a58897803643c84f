from __future__ import annotations

import time

from app.ids import new_id


def test_ids_sort_by_creation_time() -> None:
    first = new_id("job")
    time.sleep(0.002)
    second = new_id("job")
    assert first.startswith("job_") and len(first) == 30
    assert first < second


def test_ids_are_unique() -> None:
    assert len({new_id("job") for _ in range(10_000)}) == 10_000
