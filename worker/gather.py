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
    caller of that call (the same exception object, so its type decides each caller's
    retry or fallback); each caller then decides on its own."""

    def __init__(self, run: Callable[[list[T]], R], key: Callable[[T], Hashable], limit: int = LIMIT) -> None:
        self._run = run
        self._key = key
        self._limit = limit
        self._waiting: list[_Call[T, R]] = []
        self._running = False  # a joined call is under way
        self._changed = threading.Condition()  # guards the two above; told when a call ends

    def __call__(self, items: list[T]) -> R:
        call: _Call[T, R] = _Call(items)
        with self._changed:
            self._waiting.append(call)
            while not call.done:
                if self._running:
                    # Its callers are told as soon as a joined call ends: one that took this
                    # call along returns at once, not after the next statement.
                    self._changed.wait()
                    continue
                group = self._take()
                self._running = True
                self._changed.release()
                try:
                    answer, error = self._run([item for member in group for item in member.items]), None
                except BaseException as exc:  # noqa: BLE001 - handed to every caller, raised there
                    answer, error = None, exc
                finally:
                    self._changed.acquire()
                for member in group:
                    member.answer, member.error, member.done = answer, error, True
                self._running = False
                self._changed.notify_all()
        if call.error is not None:
            raise call.error
        return call.answer  # type: ignore[return-value]

    def _take(self) -> list[_Call[T, R]]:
        """The waiting calls to join now (the caller holds the lock): from the oldest on, up to
        `limit` items (the oldest call always, whatever its size), skipping a call that holds
        a key already taken; the rest wait for the next call."""
        group: list[_Call[T, R]] = []
        keys: set[Hashable] = set()
        size = 0
        left: list[_Call[T, R]] = []
        for call in self._waiting:
            mine = {self._key(item) for item in call.items}
            if not group or (size + len(call.items) <= self._limit and not keys & mine):
                group.append(call)
                keys |= mine
                size += len(call.items)
            else:
                left.append(call)
        self._waiting = left
        return group
