"""`llmq up`'s restart delay: per child, doubling up to a cap, reset after a healthy run."""

from __future__ import annotations

from pathlib import Path

from app.cli.stack import Backoff, Stack
from app.settings import Settings


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def crash_loop(backoff: Backoff, clock: Clock, crashes: int, uptime: float = 1.0) -> list[float]:
    """The delays of `crashes` exits, each after `uptime` seconds up."""
    delays = []
    for _ in range(crashes):
        clock.now += uptime
        delay = backoff.exited()
        delays.append(delay)
        clock.now += delay
        backoff.started()
    return delays


def test_the_delay_doubles_up_to_its_cap() -> None:
    clock = Clock()
    assert crash_loop(Backoff(clock=clock), clock, 7) == [1, 2, 4, 8, 16, 30, 30]


def test_the_delay_is_reset_after_a_healthy_period() -> None:
    clock = Clock()
    backoff = Backoff(healthy=60, clock=clock)
    assert crash_loop(backoff, clock, 6) == [1, 2, 4, 8, 16, 30]
    # Up for a minute: the next crash is a new incident, restarted at once.
    assert crash_loop(backoff, clock, 3, uptime=60) == [1, 1, 1]
    # Up for less than the healthy period: still in the crash loop.
    assert crash_loop(backoff, clock, 3, uptime=59) == [2, 4, 8]


def test_each_child_has_its_own_delay(tmp_path: Path) -> None:
    stack = Stack(Settings(), host="127.0.0.1", port=0, data_dir=tmp_path)
    worker, api = stack._backoff["worker"], stack._backoff["api"]
    assert [worker.exited() for _ in range(5)] == [1, 2, 4, 8, 16]
    assert api.exited() == 1  # the API's first crash does not wait out the worker's loop
