"""worker/gather.py: calls made while one runs go together in the next; a lone call goes at
once; two calls for the same key never share one; an error reaches every caller of its call."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial

import pytest

from tests.unit.test_runner import wait_until
from worker.gather import Gather


class Recorded:
    """A `run` that records the items of each call and holds the first until released."""

    def __init__(self, fail_on: str | None = None) -> None:
        self.calls: list[list[str]] = []
        self.release = threading.Event()
        self._fail_on = fail_on

    def __call__(self, items: list[str]) -> set[str]:
        self.calls.append(list(items))
        if len(self.calls) == 1:
            assert self.release.wait(10)
        if self._fail_on in items:
            raise RuntimeError(f"refused {self._fail_on}")
        return {i.upper() for i in items}


def queued(gather: Gather[str, set[str]], n: int) -> bool:
    """`n` calls wait for the turn (the queue is what these tests are about)."""
    return len(gather._waiting) == n


def behind_a_running_call(
    gather: Gather[str, set[str]], run: Recorded, later: list[list[str]]
) -> list[Future[set[str]]]:
    """The first call holds the turn; `later` calls are made while it runs, then it ends."""
    pool = ThreadPoolExecutor(len(later) + 1)
    futures = [pool.submit(gather, ["a"])]
    wait_until(lambda: run.calls)
    for items in later:
        futures.append(pool.submit(gather, items))
        wait_until(partial(queued, gather, len(futures) - 1))
    run.release.set()
    pool.shutdown(wait=True)
    return futures


def test_a_lone_call_goes_at_once_with_its_own_items() -> None:
    run = Recorded()
    run.release.set()
    gather: Gather[str, set[str]] = Gather(run, key=lambda item: item)
    assert gather(["a", "b"]) == {"A", "B"}
    assert run.calls == [["a", "b"]]


def test_calls_made_while_one_runs_go_together_in_the_next() -> None:
    run = Recorded()
    gather: Gather[str, set[str]] = Gather(run, key=lambda item: item)
    futures = behind_a_running_call(gather, run, [["b"], ["c", "d"], ["e"]])
    assert run.calls == [["a"], ["b", "c", "d", "e"]]
    assert futures[0].result() == {"A"}
    assert all(f.result() == {"B", "C", "D", "E"} for f in futures[1:])


def test_two_calls_for_the_same_key_never_share_one() -> None:
    run = Recorded()
    gather: Gather[str, set[str]] = Gather(run, key=lambda item: item)
    behind_a_running_call(gather, run, [["b"], ["c", "b"], ["d"], ["b"]])
    assert run.calls == [["a"], ["b", "d"], ["c", "b"], ["b"]]


def test_a_call_takes_at_most_the_limit_of_items() -> None:
    run = Recorded()
    gather: Gather[str, set[str]] = Gather(run, key=lambda item: item, limit=3)
    behind_a_running_call(gather, run, [["b", "c"], ["d", "e"], ["f"]])
    assert run.calls == [["a"], ["b", "c", "f"], ["d", "e"]]


def test_an_error_reaches_every_caller_of_its_call_and_no_other() -> None:
    run = Recorded(fail_on="c")
    gather: Gather[str, set[str]] = Gather(run, key=lambda item: item)
    futures = behind_a_running_call(gather, run, [["b"], ["c"], ["b"]])
    assert run.calls == [["a"], ["b", "c"], ["b"]]
    assert futures[0].result() == {"A"}
    for failed in futures[1:3]:
        with pytest.raises(RuntimeError, match="refused c"):
            failed.result()
    assert futures[3].result() == {"B"}
