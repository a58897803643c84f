"""The batch scheduler thread of a worker: feeds batch lines to the broker, ends batches at
their deadline and finalizes finished ones. Every worker runs it; one acts at a time.

It runs every tick, and at once when a worker ends a chunk of lines or the API creates a
batch (`wake_feeder`): the freed slots get their next lines, and a new batch its first,
without waiting out the tick. Finished batches are looked for once a second, and in every
round that finds no line owed a message: a batch completes as its last chunk ends.
Wake-ups coalesce in a one-element Redis list that the schedulers wait on (BLPOP); a
wake-up taken by a scheduler that does not hold the lock is lost, and the tick still comes.

While no batch is active (none validating, in progress, cancelling or finalizing), nothing
can be owed or due: a round is one read (`any_active`, asked after an idle round and once a
second while batches are active), and the next comes after `idle_tick_seconds` instead of
the tick, unless a wake-up comes first; a scheduler that does not hold the lock waits as
long. An idle worker's feeder thread went from 10.3 ms of CPU a second (five rounds, each a
look for owed lines, and four batch queries a second) to 2.3 ms, the whole worker from 18.7
to 14.0 (30 s each, per-thread CPU from /proc). In a fleet a new batch may wait out that
idle tick when its wake-up was taken by a scheduler that does not hold the lock."""

from __future__ import annotations

import logging
import time

from redis import Redis

from app.periodic import Periodic
from app.queue import WAKE_KEY
from app.services.batch_lifecycle import BatchLifecycle
from worker.leader import LeaseLock

log = logging.getLogger("llmq.batches")

FINALIZE_EVERY_SECONDS = 1.0
# Rounds woken early still run at most this often (a fleet ending chunks by the hundred a
# second costs the feeder's queries that many times at most).
MIN_ROUND_SECONDS = 0.01


class BatchScheduler:
    def __init__(
        self,
        lock: LeaseLock,
        lifecycle: BatchLifecycle,
        *,
        tick_seconds: float,
        idle_tick_seconds: float | None = None,
        redis: Redis[bytes] | None = None,
    ) -> None:
        """`idle_tick_seconds`: the pause after a round that found no batch active, or did
        not hold the lock (None: the tick); it needs `redis`, whose wake-ups end it early."""
        self._lock = lock
        self._lifecycle = lifecycle
        self._redis = redis
        self._periodic = Periodic(
            "llmq-batches",
            tick_seconds,
            self.tick,
            log=log,
            wait=self._wait if redis is not None else None,
            min_interval=MIN_ROUND_SECONDS,
        )
        self._last_finalize = 0.0
        self._idle_tick = idle_tick_seconds or tick_seconds
        self._idle = False  # the last round held no lock or found no batch active
        self._woken = False  # the pause before this round ended with a wake-up

    def tick(self) -> None:
        idle, self._idle = self._idle, True
        woken, self._woken = self._woken, False
        # Idle and not woken, the round looks only on the fleet's turn (one such round an
        # idle tick, the first worker's to ask): each of a fleet's idle workers asked Postgres
        # once an idle tick whether any batch is active. A batch created wakes a worker,
        # whose round looks at once.
        if idle and not woken and not self._lock.turn("idle", self._idle_tick):
            return
        with self._lock.hold() as mine:
            if not mine:
                return
            now = time.monotonic()
            finalize = now - self._last_finalize >= FINALIZE_EVERY_SECONDS
            # Whether a batch is active is asked after an idle round and with each round that
            # finalizes (once a second), not in the rounds between, woken as chunks end.
            if (idle or finalize) and not self._lifecycle.any_active():
                return
            self._idle = False
            fed = self._lifecycle.feed()
            if fed.lines:
                log.debug("batch lines sent", extra={"lines": fed.lines, "messages": fed.messages})
            if finalize:
                self._last_finalize = now
                self._lifecycle.resume_validating()
                self._lifecycle.expire_due()
                self._lifecycle.end_left_lines()
                self._lifecycle.finalize_done()
            elif not fed.owed:
                # No line waits for a message: the lines out may be a batch's last, and this
                # round may be the one their chunk's end woke. The batch completes now, not
                # at the next second's round (B2 waited half a second for it on average).
                self._lifecycle.finalize_done()

    def _wait(self, seconds: float) -> None:
        """Until a wake-up or `seconds` (the idle tick after an idle round; BLPOP takes
        fractions of a second since Redis 6)."""
        assert self._redis is not None
        woken = self._redis.blpop([WAKE_KEY], timeout=self._idle_tick if self._idle else seconds)
        self._woken = woken is not None

    def start(self) -> None:
        self._periodic.start()

    def stop(self) -> None:
        self._periodic.stop()

    def join(self, timeout: float) -> bool:
        return self._periodic.join(timeout)
