"""Background threads of a worker: signal listener (cancels, streams begun), lease keeper,
registry heartbeat, presence."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from redis import Redis

from app import connections
from app.events import CANCEL_CHANNEL, WATCH_CHANNEL
from app.periodic import Periodic
from app.services.health import mark_absent, mark_present, register_worker, unregister_worker
from app.threads import name_native_thread
from worker.runner import JobRunner
from worker.store import JobStore

log = logging.getLogger("llmq.control")


class _Periodic:
    """`tick` every `interval` seconds, the first round at once, until stopped."""

    def __init__(self, name: str, interval: float, *, at_start: bool = True) -> None:
        self._periodic = Periodic(name, interval, self.tick, log=log, at_start=at_start)

    def tick(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        self._periodic.start()

    def stop(self) -> None:
        self._periodic.stop()


class LeaseKeeper(_Periodic):
    """Renews the leases of this worker's running jobs (one UPDATE for all of them);
    aborts jobs whose cancel was requested or that another worker now owns."""

    def __init__(self, store: JobStore, runner: JobRunner, owner: str, lease_seconds: float) -> None:
        super().__init__("llmq-leases", lease_seconds / 3)
        self._store = store
        self._runner = runner
        self._owner = owner
        self._lease = lease_seconds

    def tick(self) -> None:
        inflight = self._runner.inflight()
        if not inflight:
            return
        owned = self._store.extend_leases(self._owner, self._lease)
        # A job that ended meanwhile is no longer running, so not extended: not a loss. The
        # runner drops a job from its in-flight set before saving it, so one still there
        # now had not been saved when the leases were extended.
        still = {item.job_id for item in self._runner.inflight()}
        for item in inflight:
            if item.job_id not in still:
                continue
            held = owned.get(item.job_id)
            if held is None or held[0] != item.epoch:
                log.warning("lease lost; aborting", extra={"job_id": item.job_id, "epoch": item.epoch})
                self._runner.lose(item.job_id)
            elif held[1] and not item.cancelled:
                self._runner.cancel(item.job_id)


class SignalListener:
    """Job signals published to every worker (app/events.py): a cancel aborts the job in
    the engine at once; a client who begins to stream a job takes it out of the stream
    publisher's quiet set (`watched`). Pub/sub can drop messages: for cancels the lease
    keeper's `cancel_requested_at` check is the backstop, for a stream the next flush it
    hears."""

    def __init__(self, redis: Redis[bytes], runner: JobRunner, watched: Callable[[str], None]) -> None:
        self._redis = redis
        self._handlers: dict[bytes, Callable[[str], None]] = {
            CANCEL_CHANNEL.encode(): self._cancel,
            WATCH_CHANNEL.encode(): watched,
        }
        self._runner = runner
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="llmq-signals", daemon=True)

    def _cancel(self, job_id: str) -> None:
        if self._runner.cancel(job_id):
            log.info("cancel: aborted in engine", extra={"job_id": job_id})

    def _loop(self) -> None:
        name_native_thread()
        while not self._stop.is_set():
            pubsub = connections.pubsub(self._redis, ignore_subscribe_messages=True)
            try:
                pubsub.subscribe(*self._handlers)
                while not self._stop.is_set():
                    message = pubsub.get_message(timeout=1.0)
                    if message is None:
                        continue
                    channel, data = message["channel"], message["data"]
                    handler = self._handlers.get(channel if isinstance(channel, bytes) else channel.encode())
                    if handler is not None:
                        handler(data.decode() if isinstance(data, bytes) else str(data))
            except Exception as exc:  # noqa: BLE001 - Redis away: reconnect
                log.warning("signal listener reconnecting", extra={"error": type(exc).__name__})
                self._stop.wait(1.0)
            finally:
                pubsub.close()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()


class RegistryHeartbeat(_Periodic):
    """Publishes this worker in the registry only while its consumer answers a ping that
    travels through the broker and its engine is alive (a live process is not enough).

    The first round comes when the consumer is ready (`kick`, from Celery's worker_ready),
    not when the heartbeat starts: before, the ping cannot be answered, and a new worker
    would stay out of the registry (so out of the feeder's window) for a whole interval.
    Rounds never overlap, so a late answer cannot undo a newer one."""

    def __init__(
        self,
        redis: Redis[bytes],
        name: str,
        info: Callable[[], dict[str, Any]],
        consuming: Callable[[], bool],
        interval: float,
    ) -> None:
        super().__init__("llmq-heartbeat", interval, at_start=False)
        self._redis = redis
        self._name = name
        self._info = info
        self._consuming = consuming
        self._ttl = max(3, int(interval * 3))
        self._round = threading.Lock()

    def kick(self) -> None:
        """A round now, on a thread of its own (the ping's answer needs the caller's loop)."""
        threading.Thread(target=self._guarded_tick, name="llmq-heartbeat-now", daemon=True).start()

    def _guarded_tick(self) -> None:
        try:
            self.tick()
        except Exception as exc:  # noqa: BLE001 - the periodic rounds go on
            log.warning("heartbeat failed", extra={"error": f"{type(exc).__name__}: {exc}"})

    def tick(self) -> None:
        with self._round:
            self._publish()

    def _publish(self) -> None:
        info = self._info()
        started = time.monotonic()
        info["consuming"] = bool(info.get("engine") == "ok" and self._consuming())
        info["ping_ms"] = round((time.monotonic() - started) * 1e3, 1)
        if info["consuming"]:
            register_worker(self._redis, self._name, info, self._ttl)
        else:
            unregister_worker(self._redis, self._name)

    def stop(self) -> None:
        super().stop()
        with contextlib.suppress(Exception):  # best effort on the way out
            unregister_worker(self._redis, self._name)


class Presence(_Periodic):
    """Says this process is alive, consuming or not, on a thread that does nothing else
    (the heartbeat's broker ping can take seconds). Written five times per lifetime, so a
    live worker's presence lapses only after four writes in a row are late or lost; once
    it lapses the sweeper hands this worker's running jobs to others."""

    def __init__(self, redis: Redis[bytes], name: str, ttl_seconds: float) -> None:
        super().__init__("llmq-presence", ttl_seconds / 5)
        self._redis = redis
        self._name = name
        self._ttl = ttl_seconds

    def tick(self) -> None:
        mark_present(self._redis, self._name, self._ttl)

    def stop(self) -> None:
        super().stop()
        with contextlib.suppress(Exception):  # best effort: it lapses by itself
            mark_absent(self._redis, self._name)
