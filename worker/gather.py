"""Writes that many task threads make at once, joined into one statement (a group commit).

Each single job's task thread claimed its job and stored its result with a statement and a
transaction of its own: under a burst of 64 jobs, 64 claims and 64 result writes, where the
store already takes a list of jobs for each (a batch chunk's lines go together). `Gather`
joins the calls made while one is running: a call that finds none running goes at once,
alone (a lone job's claim keeps its one-row statement); calls made meanwhile wait and go
together in the next. Nothing waits on purpose, so a quiet worker's latency is unchanged.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")

# The most items one joined call takes: a statement about as large as a batch chunk's few.
LIMIT = 256


class _Call(Generic[T, R]):
    __slots__ = ("answer", "done", "error", "items")

    def __init__(self, items: list[T]) -> None:
        self.items = items
        self.done = False
        self.answer: R | None = None
        self.error: BaseException | None = None


class Gather(Generic[T, R]):
    """`run(items)` for many callers at once: each caller gets the answer of the joined call
    its items went in (the caller reads its own share from it), or its error.

    Two callers whose items share a `key` (the same job) never go in one call: each answer
    must say what happened to each caller's items alone. A call's error is raised in every
    caller of that call; each caller then decides on its own (retry, write alone)."""

    def __init__(self, run: Callable[[list[T]], R], key: Callable[[T], Hashable], limit: int = LIMIT) -> None:
        self._run = run
        self._key = key
        self._limit = limit
        self._waiting: list[_Call[T, R]] = []
        self._lock = threading.Lock()  # guards _waiting
        self._turn = threading.Lock()  # one joined call at a time

    def __call__(self, items: list[T]) -> R:
        call: _Call[T, R] = _Call(items)
        with self._lock:
            self._waiting.append(call)
        with self._turn:
            # Another caller's turn may have taken this call along; else this caller runs
            # what waits (its own call among it) until its own is done.
            while not call.done:
                self._run_group(self._take())
        if call.error is not None:
            raise call.error
        return call.answer  # type: ignore[return-value]

    def _take(self) -> list[_Call[T, R]]:
        """The calls that wait, oldest first, up to `limit` items (always one call) and never
        two holding the same key; the rest wait for the next turn."""
        group: list[_Call[T, R]] = []
        keys: set[Hashable] = set()
        size = 0
        with self._lock:
            left: list[_Call[T, R]] = []
            for call in self._waiting:
                mine = {self._key(item) for item in call.items}
                fits = not group or (size + len(call.items) <= self._limit and not keys & mine)
                if fits and len(mine) == len(call.items):
                    group.append(call)
                    keys |= mine
                    size += len(call.items)
                elif not group:
                    group.append(call)  # a call that repeats its own key goes alone
                    break
                else:
                    left.append(call)
            self._waiting = left + self._waiting[len(group) + len(left) :]
        return group

    def _run_group(self, group: list[_Call[T, R]]) -> None:
        """Run `group`'s items as one call; its answer or error goes to each of its callers
        (raised by each in its own thread, this one's too if its call was in it)."""
        try:
            answer = self._run([item for call in group for item in call.items])
        except BaseException as exc:  # noqa: BLE001 - handed to every caller, raised there
            for call in group:
                call.error = exc
                call.done = True
            return
        for call in group:
            call.answer = answer
            call.done = True
