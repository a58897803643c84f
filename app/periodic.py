"""A daemon thread that runs one callable every `interval` seconds until stopped: the
worker's lease keeper, heartbeat, presence, batch scheduler and sampler, and the API's
slot refresher. A failed round is logged and tried again next round; it never ends the
thread."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable


class Periodic:
    def __init__(
        self,
        name: str,
        interval: float,
        tick: Callable[[], object],
        *,
        log: logging.Logger,
        at_start: bool = False,
    ) -> None:
        """`tick`'s answer is ignored. `at_start`: run the first round as soon as the
        thread starts, not one interval later."""
        self.name = name
        self._interval = interval
        self._tick = tick
        self._log = log
        self._at_start = at_start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def _loop(self) -> None:
        if self._at_start:
            self._round()
        while not self._stop.wait(self._interval):
            self._round()

    def _round(self) -> None:
        try:
            self._tick()
        except Exception as exc:  # noqa: BLE001 - Postgres or Redis away: the next round retries
            self._log.warning("%s failed", self.name, extra={"error": f"{type(exc).__name__}: {exc}"})

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    @property
    def started(self) -> bool:
        return self._thread.ident is not None
