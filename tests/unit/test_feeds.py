"""A job's shared feed (app/services/feeds.py) against fakeredis: which carried events it
keeps from their notifications, and when it reads the log instead."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import fakeredis
import pytest
from redis import Redis

from app.events import EventId, job_stream
from app.services.feeds import JobFeed


class Log:
    """The job's Redis Stream and the notifications a process has seen of it."""

    def __init__(self, r: Redis[bytes], job_id: str) -> None:
        self.r, self.job_id = r, job_id
        self.version = 0
        self.feed = JobFeed(r, job_id, lambda: self.version)

    def append(self, eid: str, *, announce: bool = True, carry: bool = True) -> None:
        """Append the event; if `announce`, the notifier sees a notification that carries
        it (`carry`) or only names it."""
        raw = json.dumps(chunk(eid)).encode()
        self.r.xadd(job_stream(self.job_id), {"e": raw}, id=eid)
        if announce:
            self.version += 1
            if carry:
                epoch, seq = eid.split("-")
                self.feed.offer(EventId(int(epoch), int(seq)), raw, self.version)


def chunk(eid: str) -> dict[str, Any]:
    return {"id": eid, "type": "chunk", "data": {"n": eid}}


def ids(events: list[dict[str, Any]]) -> list[str]:
    return [e["id"] for e in events]


@pytest.fixture
def log() -> Iterator[Log]:
    r: Redis[bytes] = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    yield Log(r, "job_feed")
    r.close()


def test_carried_events_that_follow_the_log_are_not_read_back(log: Log) -> None:
    assert log.feed.after(None).events == []  # a subscriber reads once as it opens
    for seq in range(1, 6):
        log.append(f"1-{seq}")
    read = log.feed.after(EventId(1, 2))
    assert ids(read.events) == ["1-3", "1-4", "1-5"] and read.exists
    assert log.feed.reads == 1 and log.feed.carried == 5


def test_a_gap_is_read_from_the_log_in_order(log: Log) -> None:
    log.feed.after(None)
    log.append("1-1")
    log.append("1-2", announce=False)  # its notification was lost
    log.append("1-3")
    assert log.feed.carried == 1
    assert ids(log.feed.after(None).events) == ["1-1", "1-2", "1-3"]
    assert log.feed.reads == 2


def test_a_notification_that_names_its_event_only_is_read(log: Log) -> None:
    log.feed.after(None)
    log.append("1-1", carry=False)
    log.append("1-2")  # follows nothing the feed holds yet: not kept either
    assert log.feed.carried == 0
    assert ids(log.feed.after(None).events) == ["1-1", "1-2"]
    log.append("1-3")
    assert ids(log.feed.after(EventId(1, 2)).events) == ["1-3"]
    assert log.feed.reads == 2 and log.feed.carried == 1


def test_a_new_attempt_is_read_from_the_log(log: Log) -> None:
    log.feed.after(None)
    log.append("1-1")
    log.r.delete(job_stream(log.job_id))  # the next attempt's worker starts a clean log
    log.append("2-1")
    assert log.feed.carried == 1
    assert ids(log.feed.after(None).events) == ["2-1"]


def test_a_feed_nobody_reads_keeps_nothing(log: Log) -> None:
    """Its job is only waited on (a request that wants the result): the events of a long
    job are not held in memory for nobody."""
    for seq in range(1, 4):
        log.append(f"1-{seq}")
    assert log.feed.carried == 0
    assert ids(log.feed.after(None).events) == ["1-1", "1-2", "1-3"]
    assert log.feed.reads == 1


def test_an_offer_while_the_log_is_being_read_is_left_to_the_read(log: Log) -> None:
    """The process's one notifier never waits for a subscriber's XRANGE."""
    log.feed.after(None)
    with log.feed._lock:  # a subscriber is reading
        log.append("1-1")
    assert log.feed.carried == 0
    assert ids(log.feed.after(None).events) == ["1-1"]
