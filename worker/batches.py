"""The batch scheduler thread of a worker: feeds batch lines to the broker, ends batches at
their deadline and finalizes finished ones. Every worker runs it; one acts at a time.

It runs every tick, and at once when a worker ends a chunk of lines (`wake_feeder`): the
freed slots get their next lines without waiting out the tick. Wake-ups coalesce in a
one-element Redis list that the schedulers wait on (BLPOP); a wake-up taken by a scheduler
that does not hold the lock is lost, and the tick still comes."""

from __future__ import annotations

import logging
import time

from redis import Redis

from app.periodic import Periodic
from app.services.batch_lifecycle import BatchLifecycle
from worker.leader import LeaseLock

log = logging.getLogger("llmq.batches")

FINALIZE_EVERY_SECONDS = 1.0
WAKE_KEY = "llmq:batches:wake"
# Rounds woken early still run at most this often (a fleet ending chunks by the hundred a
# second costs the feeder's queries that many times at most).
MIN_ROUND_SECONDS = 0.01


def wake_feeder(redis: Redis[bytes]) -> None:
    """Slots freed: the feeder's next round runs now (one round trip, never blocks)."""
    pipe = redis.pipeline(transaction=False)
    pipe.lpush(WAKE_KEY, b"1")
    pipe.ltrim(WAKE_KEY, 0, 0)
    pipe.execute()


class BatchScheduler:
    def __init__(
        self,
        lock: LeaseLock,
        lifecycle: BatchLifecycle,
        *,
        tick_seconds: float,
        redis: Redis[bytes] | None = None,
    ) -> None:
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

    def tick(self) -> None:
        with self._lock.hold() as mine:
            if not mine:
                return
            fed = self._lifecycle.feed()
            if fed.lines:
                log.debug("batch lines sent", extra={"lines": fed.lines, "messages": fed.messages})
            now = time.monotonic()
            if now - self._last_finalize >= FINALIZE_EVERY_SECONDS:
                self._last_finalize = now
                self._lifecycle.resume_validating()
                self._lifecycle.expire_due()
                self._lifecycle.end_left_lines()
                self._lifecycle.finalize_done()

    def _wait(self, seconds: float) -> None:
        """Until a wake-up or `seconds` (BLPOP takes fractions of a second since Redis 6)."""
        assert self._redis is not None
        self._redis.blpop([WAKE_KEY], timeout=seconds)

    def start(self) -> None:
        self._periodic.start()

    def stop(self) -> None:
        self._periodic.stop()

    def join(self, timeout: float) -> bool:
        return self._periodic.join(timeout)
