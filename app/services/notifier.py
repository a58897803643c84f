"""One shared pub/sub connection per process (`Notifier`): live events wake the watchers of
a job's log, so an idle subscriber holds no Redis connection and, under gevent, no thread."""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from redis import Redis
from redis.exceptions import RedisError

from app import connections
from app.events import carried_event, end_channel, is_end_notification, job_channel
from app.services.feeds import JobFeed

log = logging.getLogger("llmq.stream")

# How long a message that has begun to arrive may take to arrive whole (a read returns as
# soon as it has; only a message cut off mid-way by a slow or dying connection waits).
_REST_OF_MESSAGE_SECONDS = 5.0


class Waiter:
    def __init__(self, feed: JobFeed) -> None:
        self._event = threading.Event()
        self.ended = False
        self.feed = feed  # shared by every watcher of the job in this process

    def notify(self, final: bool) -> None:
        self.ended = self.ended or final
        self._event.set()

    def wait(self, timeout: float) -> bool:
        fired = self._event.wait(timeout)
        self._event.clear()
        return fired


class Notifier:
    """One pub/sub connection for the whole process. Channels are subscribed while someone
    watches them; a watcher is woken on every append to its job's log.

    The pub/sub thread waits on the connection and on a wake-up socket together, so a new
    watcher's SUBSCRIBE goes out at once: with a timed poll alone, every stream opened (and
    every `wait_for_end`) first waited up to the poll period for its subscription, about
    half of the time a one-stream request added to the engine's first token."""

    def __init__(self, redis: Redis[bytes], *, poll_seconds: float = 0.05) -> None:
        self._redis = redis
        self._poll = poll_seconds
        # Written by `watch` (and `close`), read by the pub/sub thread. Under gevent both are
        # gevent sockets and `select` yields to other greenlets.
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._lock = threading.Lock()
        self._waiters: dict[str, set[Waiter]] = {}
        self._pending: list[tuple[str, str]] = []  # ("sub" | "unsub", channel)
        self._confirmed: dict[str, threading.Event] = {}
        # Notifications seen per channel: a job's feed reads Redis again only when it moved.
        self._versions: dict[str, int] = {}
        self._feeds: dict[str, JobFeed] = {}
        self._thread: threading.Thread | None = None
        self._closing = threading.Event()

    def close(self, timeout: float = 2.0) -> None:
        """Stop the pub/sub thread (before the Redis client it reads is closed)."""
        self._closing.set()
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                return
        self._wake_r.close()
        self._wake_w.close()

    def _wake(self) -> None:
        # OSError: wake-ups already fill the buffer (BlockingIOError), or the notifier closed.
        with contextlib.suppress(OSError):
            self._wake_w.send(b"w")

    def _ensure_started(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="llmq-notifier", daemon=True)
                self._thread.start()

    @contextmanager
    def watch(self, job_id: str, timeout: float = 5.0, *, end_only: bool = False) -> Iterator[Waiter]:
        """Subscribed (confirmed by Redis) before the block starts, so nothing appended
        after the caller's next read can be missed. `end_only`: woken by the job's end alone
        (`llmq:end:<id>`), not counted as a hearer of its chunks (app/events.py)."""
        self._ensure_started()
        channel = end_channel(job_id) if end_only else job_channel(job_id)
        with self._lock:
            first = channel not in self._waiters
            feed = self._feeds.get(channel)
            if feed is None:
                feed = self._feeds[channel] = JobFeed(
                    self._redis, job_id, lambda: self._versions.get(channel, 0)
                )
            waiter = Waiter(feed)
            self._waiters.setdefault(channel, set()).add(waiter)
            confirmed = self._confirmed.setdefault(channel, threading.Event())
            if first:
                self._pending.append(("sub", channel))
        if first:
            self._wake()
        confirmed.wait(timeout)
        try:
            yield waiter
        finally:
            with self._lock:
                watchers = self._waiters.get(channel)
                if watchers is not None:
                    watchers.discard(waiter)
                    if not watchers:
                        del self._waiters[channel]
                        self._confirmed.pop(channel, None)
                        self._versions.pop(channel, None)
                        self._feeds.pop(channel, None)
                        self._pending.append(("unsub", channel))

    def _loop(self) -> None:
        while not self._closing.is_set():
            pubsub = connections.pubsub(self._redis)
            try:
                with self._lock:
                    channels = list(self._waiters)
                    self._pending.clear()
                if channels:
                    pubsub.subscribe(*channels)
                # Whatever happened while disconnected, look again. Not a confirmation: a
                # watch that came after the snapshot above is subscribed by its pending op,
                # and returns when Redis confirms that.
                self._wake_all(confirm=False)
                while not self._closing.is_set():
                    self._apply_pending(pubsub)
                    message = self._next_message(pubsub)
                    if message is not None:
                        self._dispatch(message)
            except RedisError as exc:
                log.warning("notifier reconnecting", extra={"error": type(exc).__name__})
                self._wake_all(confirm=True)  # no watch waits out its timeout on a dead connection
                self._closing.wait(0.5)
            finally:
                pubsub.close()

    def _next_message(self, pubsub: Any) -> dict[str, Any] | None:
        """A message that is ready now; else wait until the connection has data, a watcher
        wakes the thread, or the poll period passes, and return what is ready then.

        Never a read with no timeout: redis-py's read of a message that has only partly
        arrived (an event's JSON of a few hundred kB, split across segments) raises a
        timeout, and the pub/sub retry would drop the connection, and with it that message
        and whatever is published while it reconnects. `can_read` (the parser's buffer, then
        the socket) decides; the read that follows returns as soon as a whole message is
        there, and gives the rest of one that has begun `_REST_OF_MESSAGE_SECONDS`."""
        connection = pubsub.connection if pubsub.subscribed else None
        sock = getattr(connection, "_sock", None)
        if connection is not None and sock is None:
            # Not connected (redis-py reconnects inside its own read): its timed read.
            return pubsub.get_message(timeout=self._poll)  # type: ignore[no-any-return]
        if connection is not None and connection.can_read(timeout=0):  # parsed data first
            return pubsub.get_message(timeout=_REST_OF_MESSAGE_SECONDS)  # type: ignore[no-any-return]
        waiting = [self._wake_r] if sock is None else [self._wake_r, sock]
        ready, _, _ = select.select(waiting, [], [], self._poll)
        if self._wake_r in ready:
            with contextlib.suppress(OSError):  # BlockingIOError once it is empty
                while self._wake_r.recv(4096):
                    pass
        if sock is not None and sock in ready:
            return pubsub.get_message(timeout=_REST_OF_MESSAGE_SECONDS)  # type: ignore[no-any-return]
        return None

    def _apply_pending(self, pubsub: Any) -> None:
        with self._lock:
            ops, self._pending = self._pending, []
        for op, channel in ops:
            if op == "sub":
                pubsub.subscribe(channel)
            else:
                pubsub.unsubscribe(channel)

    def _dispatch(self, message: dict[str, Any]) -> None:
        channel = message["channel"].decode() if isinstance(message["channel"], bytes) else message["channel"]
        kind = message["type"]
        with self._lock:
            if kind == "subscribe":
                confirmed = self._confirmed.get(channel)
                if confirmed is not None:
                    confirmed.set()
                return
            if kind != "message":
                return
            # Before anyone wakes, so a woken subscriber's feed sees the log moved.
            version = self._versions[channel] = self._versions.get(channel, 0) + 1
            waiters = list(self._waiters.get(channel, ()))
            feed = self._feeds.get(channel)
        data = message["data"]
        carried = carried_event(data) if feed is not None and isinstance(data, bytes) else None
        if carried is not None:
            assert feed is not None
            feed.offer(*carried, version)
        final = is_end_notification(data)
        for waiter in waiters:
            waiter.notify(final)

    def _wake_all(self, *, confirm: bool) -> None:
        with self._lock:
            waiters = [w for ws in self._waiters.values() for w in ws]
            for channel in self._waiters:
                self._versions[channel] = self._versions.get(channel, 0) + 1
            if confirm:
                for confirmed in self._confirmed.values():
                    confirmed.set()
        for waiter in waiters:
            waiter.notify(False)
