"""The worker's job slots: at most `capacity` jobs in the engine at once, counted per job
(a chunk of batch lines takes one slot per line), whichever task thread runs them.

A taker waits for one free slot, then takes as many as it asked for and are free, never
more, and never waits while holding slots: so no two takers can wait on each other.
"""

from __future__ import annotations

import threading


class JobSlots:
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self._used = 0
        self._freed = threading.Condition()

    @property
    def used(self) -> int:
        with self._freed:
            return self._used

    def take(self, wanted: int, timeout: float | None = None) -> int:
        """Wait until a slot is free, for at most `timeout` seconds (None: for ever); take
        up to `wanted`. Returns how many were taken: at least 1 when `wanted` is, unless
        the wait timed out (0)."""
        if wanted <= 0:
            return 0
        with self._freed:
            if not self._freed.wait_for(lambda: self._used < self.capacity, timeout):
                return 0
            granted = min(wanted, self.capacity - self._used)
            self._used += granted
            return granted

    def give(self, count: int) -> None:
        if count <= 0:
            return
        with self._freed:
            self._used -= count
            assert self._used >= 0, "more slots given back than taken"
            self._freed.notify_all()
