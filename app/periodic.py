"""A daemon thread that runs one callable every `interval` seconds until stopped: the
worker's lease keeper, heartbeat, presence, batch scheduler and sampler, and the API's
slot refresher. A failed round is logged and tried again next round; it never ends the
thread. A `wait` can end the pause early (the batch feeder is woken when job slots free),
never more often than every `min_interval` seconds."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from app.threads import name_native_thread


class Periodic:
    def __init__(
        self,
        name: str,
        interval: float,
        tick: Callable[[], object],
        *,
        log: logging.Logger,
        at_start: bool = False,
        wait: Callable[[float], object] | None = None,
        min_interval: float = 0.0,
    ) -> None:
        """`tick`'s answer is ignored. `at_start`: run the first round as soon as the
        thread starts, not one interval later. `wait(seconds)` pauses between rounds in
        place of a plain sleep, and may return early (woken); an error in it falls back to
        the sleep."""
        self.name = name
        self._interval = interval
        self._tick = tick
        self._log = log
        self._at_start = at_start
        self._wait = wait
        self._min_interval = min_interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def _loop(self) -> None:
        name_native_thread()
        if self._at_start:
            self._round()
        while not self._pause():
            self._round()

    def _pause(self) -> bool:
        """Wait for the next round; whether to stop instead."""
        if self._wait is None:
            return self._stop.wait(self._interval)
        started = time.monotonic()
        try:
            self._wait(self._interval)
        except Exception as exc:  # noqa: BLE001 - the wake-up is an optimization; sleep instead
            self._log.debug("%s wait failed", self.name, extra={"error": f"{type(exc).__name__}: {exc}"})
            return self._stop.wait(self._interval)
        rest = self._min_interval - (time.monotonic() - started)
        return self._stop.wait(rest) if rest > 0 else self._stop.is_set()

    def _round(self) -> None:
        try:
            self._tick()
        except Exception as exc:  # noqa: BLE001 - Postgres or Redis away: the next round retries
            self._log.warning("%s failed", self.name, extra={"error": f"{type(exc).__name__}: {exc}"})

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for a stopped thread to end; whether it has."""
        if self.started:
            self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def started(self) -> bool:
        return self._thread.ident is not None
