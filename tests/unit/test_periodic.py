"""The one periodic thread: a failed round is logged and the next round still runs."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from app.periodic import Periodic
from tests.unit.test_runner import wait_until


def test_a_failed_round_is_logged_and_the_thread_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    rounds: list[int] = []

    def tick() -> None:
        rounds.append(len(rounds))
        if len(rounds) == 1:
            raise RuntimeError("Redis away")

    periodic = Periodic("llmq-test", 0.01, tick, log=logging.getLogger("llmq.test"), at_start=True)
    with caplog.at_level(logging.WARNING, logger="llmq.test"):
        periodic.start()
        try:
            wait_until(lambda: len(rounds) >= 3)
        finally:
            periodic.stop()
    assert periodic.started
    assert [r.getMessage() for r in caplog.records] == ["llmq-test failed"]
    assert caplog.records[0].error == "RuntimeError: Redis away"  # type: ignore[attr-defined]


def test_it_stops_and_runs_nothing_before_it_starts() -> None:
    rounds: list[int] = []
    periodic = Periodic("llmq-test", 0.01, lambda: rounds.append(1), log=logging.getLogger("llmq.test"))
    assert not periodic.started and rounds == []
    periodic.start()
    wait_until(lambda: rounds)
    periodic.stop()
    settled = len(rounds)
    wait_until(lambda: not periodic._thread.is_alive())
    assert len(rounds) == settled


def test_a_wait_that_returns_early_runs_the_next_round_early_but_not_sooner_than_the_floor() -> None:
    rounds: list[float] = []
    woken = threading.Event()

    def wait(seconds: float) -> None:
        woken.wait(seconds)
        woken.clear()

    periodic = Periodic(
        "llmq-test",
        30.0,
        lambda: rounds.append(time.monotonic()),
        log=logging.getLogger("llmq.test"),
        wait=wait,
        min_interval=0.2,
    )
    # Before the thread starts: its pause's own clock starts after this one, never before.
    started = time.monotonic()
    periodic.start()
    try:
        woken.set()
        wait_until(lambda: rounds)
        assert rounds[0] - started >= 0.2  # the floor
        woken.set()
        wait_until(lambda: len(rounds) == 2)
        assert rounds[1] - started < 5.0  # long before the 30 s interval
    finally:
        periodic.stop()


def test_a_failing_wait_falls_back_to_the_interval() -> None:
    rounds: list[int] = []

    def wait(seconds: float) -> None:
        raise ConnectionError("Redis away")

    periodic = Periodic(
        "llmq-test", 0.01, lambda: rounds.append(1), log=logging.getLogger("llmq.test"), wait=wait
    )
    periodic.start()
    try:
        wait_until(lambda: len(rounds) >= 3)
    finally:
        periodic.stop()


def test_join_waits_for_a_stopped_thread_to_end() -> None:
    released = threading.Event()
    periodic = Periodic(
        "llmq-test", 30.0, lambda: None, log=logging.getLogger("llmq.test"), wait=released.wait
    )
    assert periodic.join(0.1)  # never started: nothing to wait for
    periodic.start()
    periodic.stop()
    assert not periodic.join(0.1)  # still in its wait
    released.set()
    assert periodic.join(2)
