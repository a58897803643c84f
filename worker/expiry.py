"""The file expiry thread of a worker: deletes files past their `expires_at` and the texts
of the batch lines in them (app/services/expiry.py). Every worker runs it; one acts at a
time."""

from __future__ import annotations

import logging

from app.periodic import Periodic
from app.services.expiry import FileExpiry
from worker.leader import LeaseLock

log = logging.getLogger("llmq.expiry")


class ExpiryTask:
    def __init__(self, lock: LeaseLock, expiry: FileExpiry, *, interval_seconds: float) -> None:
        self._lock = lock
        self._expiry = expiry
        self._periodic = Periodic("llmq-expiry", interval_seconds, self.tick, log=log)

    def tick(self) -> None:
        with self._lock.hold() as mine:
            if not mine:
                return
            report = self._expiry.expire_due()
            if report.files:
                log.info(
                    "files expired",
                    extra={"files": report.files, "lines_cleared": report.lines_cleared},
                )

    def start(self) -> None:
        self._periodic.start()

    def stop(self) -> None:
        self._periodic.stop()
