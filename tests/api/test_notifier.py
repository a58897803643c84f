"""The process's pub/sub notifier (app/services/notifier.py) against a real Redis: a new
watcher is subscribed at once, not at the pub/sub thread's next poll, and events still wake
their watchers."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator

import pytest
import redis

from app.events import job_channel, notification
from app.services.notifier import Notifier
from tests.helpers import Stores

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


def test_close_stops_the_thread_without_waiting_out_the_poll(stores: Stores) -> None:
    client: redis.Redis[bytes] = redis.Redis.from_url(stores.redis_url)
    n = Notifier(client, poll_seconds=POLL_SECONDS)
    with n.watch(job()):
        time.sleep(0.2)
    started = time.monotonic()
    n.close(timeout=POLL_SECONDS + 2)
    assert time.monotonic() - started < 1.0
    client.close()
