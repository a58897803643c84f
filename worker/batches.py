"""The batch scheduler thread of a worker: feeds batch lines to the broker, ends batches at
their deadline and finalizes finished ones. Every worker runs it; one acts at a time."""

from __future__ import annotations

import logging
import time

from app.periodic import Periodic
from app.services.batch_lifecycle import BatchLifecycle
from worker.leader import LeaseLock

log = logging.getLogger("llmq.batches")

FINALIZE_EVERY_SECONDS = 1.0


class BatchScheduler:
    def __init__(self, lock: LeaseLock, lifecycle: BatchLifecycle, *, tick_seconds: float) -> None:
        self._lock = lock
        self._lifecycle = lifecycle
        self._periodic = Periodic("llmq-batches", tick_seconds, self.tick, log=log)
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
                self._lifecycle.finalize_done()

    def start(self) -> None:
        self._periodic.start()

    def stop(self) -> None:
        self._periodic.stop()
