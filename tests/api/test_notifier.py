"""The process's pub/sub notifier (app/services/notifier.py) against a real Redis: a new
watcher is subscribed at once, not at the pub/sub thread's next poll, and events still wake
their watchers."""

from __future__ import annotations

import contextlib
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest
import redis

from app import connections
from app.events import job_channel, notification
from app.services.notifier import Notifier
from tests.helpers import Stores, next_message, wait_subscribers

# Far longer than any subscription takes: a watcher that waited for the poll would show.
POLL_SECONDS = 3.0


@pytest.fixture
def notifier(stores: Stores) -> Iterator[tuple[Notifier, redis.Redis[bytes]]]:
    client: redis.Redis[bytes] = redis.Redis.from_url(stores.redis_url)
    n = Notifier(client, poll_seconds=POLL_SECONDS)
    yield n, client
    n.close(timeout=POLL_SECONDS + 2)
    client.close()


def job() -> str:
    return f"job_{secrets.token_hex(8)}"


def test_each_new_watcher_is_subscribed_at_once(notifier: tuple[Notifier, redis.Redis[bytes]]) -> None:
    n, _ = notifier
    timings = []
    with n.watch(job()):  # the thread starts and settles into its wait on the connection
        time.sleep(0.2)
        for _ in range(5):
            started = time.monotonic()
            with n.watch(job(), timeout=POLL_SECONDS + 1):
                timings.append(time.monotonic() - started)
    assert max(timings) < 0.5, timings


def test_a_watcher_is_woken_by_its_jobs_events_and_by_no_other(
    notifier: tuple[Notifier, redis.Redis[bytes]],
) -> None:
    n, client = notifier
    mine, other = job(), job()
    with n.watch(other), n.watch(mine) as waiter:
        time.sleep(0.2)
        while waiter.wait(0):  # the first connection wakes every watcher once
            pass
        client.publish(job_channel(other), notification("1-1", final=False))
        assert not waiter.wait(0.3)
        started = time.monotonic()
        client.publish(job_channel(mine), notification("1-1", final=True))
        assert waiter.wait(POLL_SECONDS + 1)
        assert time.monotonic() - started < 0.5
        assert waiter.ended


class HalvingProxy:
    """A TCP relay to Redis that hands each of the server's writes to the client in two
    halves, 0.2 s apart (four polls of the notifier's): every message arrives partly first,
    as a large one does across a network."""

    def __init__(self, redis_url: str) -> None:
        target = urlsplit(redis_url)
        self._target = (target.hostname or "127.0.0.1", target.port or 6379)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"redis://127.0.0.1:{self._listener.getsockname()[1]}{target.path}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                client, _ = self._listener.accept()
                server = socket.create_connection(self._target)
                threading.Thread(target=self._relay, args=(client, server, False), daemon=True).start()
                threading.Thread(target=self._relay, args=(server, client, True), daemon=True).start()

    @staticmethod
    def _relay(src: socket.socket, dst: socket.socket, halve: bool) -> None:
        with contextlib.suppress(OSError), src, dst:
            while data := src.recv(65536):
                if halve and len(data) > 1:
                    dst.sendall(data[: len(data) // 2])
                    time.sleep(0.2)
                    data = data[len(data) // 2 :]
                dst.sendall(data)

    def close(self) -> None:
        self._listener.close()


def test_messages_that_arrive_in_parts_are_read_whole_without_a_reconnect(stores: Stores) -> None:
    """A read that gave up on a message half there made the pub/sub thread drop its
    connection, and with it that message and those published while it reconnected (seen
    with notifications carrying events of a megabyte): here every message comes in halves,
    and each is read whole, the last one ending the watch."""
    proxy = HalvingProxy(stores.redis_url)
    subscriber: redis.Redis[bytes] = redis.Redis.from_url(proxy.url)
    publisher: redis.Redis[bytes] = redis.Redis.from_url(stores.redis_url)
    n = Notifier(subscriber)  # the default poll, as the API runs it
    mine = job()
    try:
        with n.watch(mine, timeout=5) as waiter:
            while waiter.wait(0.5):  # the first connection wakes every watcher once
                pass
            for seq in range(1, 6):
                publisher.publish(job_channel(mine), notification(f"1-{seq}", final=seq == 5))
            deadline = time.monotonic() + 20
            while not waiter.ended and time.monotonic() < deadline:
                waiter.wait(1)
            assert waiter.ended
    finally:
        n.close(timeout=10)
        subscriber.close()
        publisher.close()
        proxy.close()


def test_a_watch_that_arrives_as_the_thread_connects_returns_only_once_subscribed(
    stores: Stores, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pub/sub thread wakes every watcher when it (re)connects. A watch that came just
    after the thread listed the channels to subscribe was also counted as confirmed then,
    and returned before its SUBSCRIBE went out: what was published meanwhile was lost (seen
    in CI as a watch that never ended). Here the thread is held between its list and its
    wake-up until the watch is registered, and Redis answers slowly (the halving proxy)."""
    proxy = HalvingProxy(stores.redis_url)
    subscriber: redis.Redis[bytes] = redis.Redis.from_url(proxy.url)
    publisher: redis.Redis[bytes] = redis.Redis.from_url(stores.redis_url)
    n = Notifier(subscriber)
    mine = job()
    listed, registered = threading.Event(), threading.Event()
    wake_all = n._wake_all

    def held_wake_all(*, confirm: bool) -> None:
        if not listed.is_set():
            listed.set()
            registered.wait(10)
        wake_all(confirm=confirm)

    monkeypatch.setattr(n, "_wake_all", held_wake_all)
    try:
        n._ensure_started()
        assert listed.wait(10)  # the thread has listed no channel and waits to wake them
        threading.Timer(0.3, registered.set).start()  # while the watch below waits
        with n.watch(mine, timeout=10) as waiter:
            publisher.publish(job_channel(mine), notification("1-1", final=True))
            deadline = time.monotonic() + 5
            while not waiter.ended and time.monotonic() < deadline:
                waiter.wait(1)
            assert waiter.ended
    finally:
        registered.set()
        n.close(timeout=10)
        subscriber.close()
        publisher.close()
        proxy.close()


def test_close_stops_the_thread_without_waiting_out_the_poll(stores: Stores) -> None:
    client: redis.Redis[bytes] = redis.Redis.from_url(stores.redis_url)
    n = Notifier(client, poll_seconds=POLL_SECONDS)
    with n.watch(job()):
        time.sleep(0.2)
    started = time.monotonic()
    n.close(timeout=POLL_SECONDS + 2)
    assert time.monotonic() - started < 1.0
    client.close()


def test_pubsub_messages_come_as_read_without_redis_pys_push_logging(
    stores: Stores, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under RESP3 redis-py's default push handler formats every message and looks its
    logger up to log it at DEBUG; llmq's pub/subs hand each message over as read."""
    from redis._parsers import resp3

    looked_up: list[str] = []
    real = resp3.getLogger
    monkeypatch.setattr(resp3, "getLogger", lambda name: looked_up.append(name) or real(name))
    client = connections.redis_client(stores.redis_url)
    channel = f"llmq-test:pubsub:{secrets.token_hex(4)}"
    sub = connections.pubsub(client, ignore_subscribe_messages=True)
    try:
        sub.subscribe(channel)
        wait_subscribers(client, channel, 1)
        client.publish(channel, b'{"id": "1-1"}\n1-1')
        message = next_message(sub, 5)
    finally:
        sub.close()
        client.close()
    assert message is not None
    assert (message["type"], message["channel"], message["data"]) == (
        "message",
        channel.encode(),
        b'{"id": "1-1"}\n1-1',
    )
    assert looked_up == []
