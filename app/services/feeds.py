"""One reader per job per process: the job's Redis Stream is read once per notification and
the events are handed to every subscriber of that job in this process, so 600 subscribers
of one job cost one XRANGE per event, not 600. An event that came with its notification
and follows the log as read so far costs no XRANGE at all."""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from redis import Redis

from app import jsontext
from app.events import END_EVENT, EventId, job_stream, parse_event_id

T = TypeVar("T")


@dataclass(frozen=True)
class FeedRead:
    """What a subscriber gets: the events after its cursor, whether the Redis Stream
    exists, and the last event of the log (to tell a finished log from a quiet one)."""

    events: list[dict[str, Any]]
    exists: bool
    last: dict[str, Any] | None

    def ended_at_or_before(self, cursor: EventId | None) -> bool:
        """The log is complete and the cursor is at or past its end event."""
        if self.events or self.last is None or self.last.get("type") != END_EVENT or cursor is None:
            return False
        return event_id(self.last) <= cursor


class JobFeed:
    """The job's event log as this process has read it. `version` counts the notifications
    for the job (bumped before subscribers are woken); the log is read again only when it
    moved since the last read, and by one subscriber at a time."""

    def __init__(self, redis: Redis[bytes], job_id: str, version: Callable[[], int]) -> None:
        self._redis = redis
        self._key = job_stream(job_id)
        self._version = version
        self._lock = threading.Lock()
        self._ids: list[EventId] = []
        self._events: list[dict[str, Any]] = []
        # Carried events kept but not yet parsed (the JSON of _ids[len(_events):]): a job
        # only waited on, not streamed, never pays for parsing its chunks.
        self._unparsed: list[bytes] = []
        self._exists = False
        self._read_version = -1
        self.reads = 0  # XRANGEs issued, for tests and curiosity
        self.carried = 0  # events kept from their notifications
        self._look_lock = threading.Lock()
        self._look: tuple[float, Any] | None = None  # (monotonic time it was asked, answer)

    def looked_up(self, load: Callable[[], T | None], fresh_for: float) -> T | None:
        """`load()`'s answer (a look at the job in Postgres), shared by the job's
        subscribers in this process: one loads at a time, and an answer asked for less than
        `fresh_for` seconds ago is everyone's. A burst of 600 streams on a quiet job
        reaches its heartbeat together, and each asked Postgres whether the job had ended.
        None (Postgres did not answer) is not kept."""
        with self._look_lock:
            now = time.monotonic()
            if self._look is not None and now - self._look[0] < fresh_for:
                kept: T = self._look[1]
                return kept
            answer = load()
            if answer is not None:
                self._look = (now, answer)
            return answer

    def offer(self, eid: EventId, raw: bytes, version: int) -> None:
        """An event carried by the job's notification number `version`: kept when it is the
        next event of the log as read so far (the same attempt, the next sequence number),
        and then, if this feed had read up to the notification before it, nobody reads
        Redis for it. Anything else (a gap, a new attempt) is left to the next XRANGE, as
        is an event offered while a subscriber reads the log: the process's one notifier
        does not wait on a Redis read. A feed nobody has read (its job is only waited on,
        by a request that wants the result) keeps nothing."""
        if not self._lock.acquire(blocking=False):
            return
        try:
            if self._read_version < 0:
                return
            # The first event of an attempt on an empty log, or the next one of this attempt.
            last = self._ids[-1] if self._ids else EventId(eid.epoch, 0)
            if eid.epoch != last.epoch or eid.seq != last.seq + 1:
                return
            self._ids.append(eid)
            self._unparsed.append(raw)
            self._exists = True
            self.carried += 1
            if self._read_version == version - 1:
                self._read_version = version
        finally:
            self._lock.release()

    def after(self, cursor: EventId | None) -> FeedRead:
        """Raises RedisError when Redis cannot be read (nothing is lost; the next call
        reads again)."""
        with self._lock:
            if self._unparsed:
                self._events.extend(jsontext.loads(raw) for raw in self._unparsed)
                self._unparsed.clear()
            version = self._version()
            if version != self._read_version:
                self._read()
                self._read_version = version
            start = bisect.bisect_right(self._ids, cursor) if cursor is not None else 0
            return FeedRead(self._events[start:], self._exists, self._events[-1] if self._events else None)

    def _read(self) -> None:
        events, exists = read_events(self._redis, self._key, self._ids[-1] if self._ids else None)
        self.reads += 1
        for event in events:
            eid = event_id(event)
            if self._ids and event.get("type") != END_EVENT and eid.epoch > self._ids[0].epoch:
                # A new attempt's worker deleted the log before its first event; drop the
                # older attempts here too, so a subscriber from the start sees only this one.
                keep = bisect.bisect_left(self._ids, EventId(eid.epoch, 0))
                del self._ids[:keep]
                del self._events[:keep]
            self._ids.append(eid)
            self._events.append(event)
        self._exists = bool(exists)


def read_events(redis: Redis[bytes], key: str, after: EventId | None) -> tuple[list[dict[str, Any]], bool]:
    """The events of a job's Redis Stream `key` after `after` (all of them with None), and
    whether the Stream exists at all: one round trip."""
    pipe = redis.pipeline(transaction=False)
    pipe.xrange(key, f"({after}" if after else "-", "+")
    pipe.exists(key)
    entries, exists = pipe.execute()
    return [jsontext.loads(fields[b"e"]) for _, fields in entries], bool(exists)


def event_id(event: dict[str, Any]) -> EventId:
    parsed = parse_event_id(str(event["id"]))
    assert parsed is not None
    return parsed
