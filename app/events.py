"""Redis keys, channels and event ids for job events, shared by the API and the worker.

- `llmq:cancel`          pub/sub: job ids whose cancel was requested (workers listen)
- `llmq:watch`           pub/sub: job ids a client has just begun to stream (workers
                         listen): a job nobody was hearing goes back to the live cadence
- `llmq:job:<id>`        pub/sub: "the job's event log grew": the event's id (` end` after
                         it for the last one), and from the worker the event itself before
                         that (`<event JSON>\n<id>`), so a subscriber need not read it back.
                         Its subscribers are the job's hearers (worker/streaming.py)
- `llmq:end:<id>`        pub/sub: the job's end alone (`<id> end`), for those who wait for
                         the end and read nothing before it (a synchronous answer, a cancel):
                         they are not hearers, so the job's chunks stay coalesced
- `llmq:events:<id>`     Redis Stream: the job's replayable event log (chunks, then `end`)

Event ids are `<epoch>-<seq>`: valid Redis Stream ids that grow across attempts, and the
SSE `id:` a client sends back as `Last-Event-ID`. An end event written from outside the
worker (a cancel while queued, the sweeper giving up) takes the largest sequence number of
its epoch, so it sorts after anything that attempt wrote.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from redis import Redis

from app import connections
from app.errors import InvalidRequest
from app.jsontext import compact_bytes

CANCEL_CHANNEL = "llmq:cancel"
WATCH_CHANNEL = "llmq:watch"
END_EVENT = "end"
EXTERNAL_END_SEQ = 2**62
STREAM_EXPIRE_SECONDS = 3600

_EVENT_ID = re.compile(r"^([0-9]{1,18})-([0-9]{1,19})$")


def job_channel(job_id: str) -> str:
    return f"llmq:job:{job_id}"


def end_channel(job_id: str) -> str:
    return f"llmq:end:{job_id}"


def announce_end(pipe: Any, job_id: str, event_id: str) -> None:
    """Queue on `pipe` the notifications of a job's end event: on its channel, for its
    hearers, and on its end channel, for those who wait for the end alone."""
    header = notification(event_id, final=True)
    pipe.publish(job_channel(job_id), header)
    pipe.publish(end_channel(job_id), header)


def job_stream(job_id: str) -> str:
    return f"llmq:events:{job_id}"


def notification(event_id: str, *, final: bool) -> str:
    """The pub/sub message for an appended event: its id, and ` end` for the last one. The
    worker's appends put the event's JSON and a newline before it (the header comes last,
    so a reader that knows only the header still finds ` end`)."""
    return f"{event_id} end" if final else event_id


def is_end_notification(data: Any) -> bool:
    # Only the tail is the header: a carried event before it is not decoded for this.
    if isinstance(data, bytes):
        return data.endswith(b" end")
    return str(data).endswith(" end")


def carried_event(data: bytes) -> tuple[EventId, bytes] | None:
    """The id and JSON of the event a notification carries, or None when it carries none
    (an end written from outside the worker, a log written again after Redis lost it)."""
    payload, newline, header = data.rpartition(b"\n")
    if not newline:
        return None
    match = _EVENT_ID.match(header.split(b" ", 1)[0].decode("ascii", "replace"))
    if match is None:
        return None
    return EventId(int(match.group(1)), int(match.group(2))), payload


@dataclass(frozen=True, order=True)
class EventId:
    epoch: int
    seq: int

    def __str__(self) -> str:
        return f"{self.epoch}-{self.seq}"


def parse_event_id(raw: str | None) -> EventId | None:
    """`Last-Event-ID` → EventId. Raises InvalidRequest for anything not `<epoch>-<seq>`."""
    if raw is None or raw.strip() == "":
        return None
    match = _EVENT_ID.match(raw.strip())
    if match is None:
        raise InvalidRequest(
            "Last-Event-ID must be an event id this stream sent, like `1-7`",
            param="Last-Event-ID",
            code="invalid_event_id",
        )
    return EventId(int(match.group(1)), int(match.group(2)))


def end_event(
    epoch: int, status: str, error: dict[str, Any] | None, usage: dict[str, Any] | None = None
) -> dict[str, Any]:
    """An end event written by someone other than the attempt's worker."""
    return {
        "id": str(EventId(max(epoch, 0), EXTERNAL_END_SEQ)),
        "type": END_EVENT,
        "status": status,
        "usage": usage,
        "error": error,
    }


class JobEvents:
    """Publishing and waiting on job notifications."""

    def __init__(self, redis: Redis[bytes]) -> None:
        self._redis = redis

    def request_cancel(self, job_id: str) -> None:
        self._redis.publish(CANCEL_CHANNEL, job_id)

    def request_cancels(self, job_ids: list[str], page: int = 1000) -> None:
        for start in range(0, len(job_ids), page):
            pipe = self._redis.pipeline(transaction=False)
            for job_id in job_ids[start : start + page]:
                pipe.publish(CANCEL_CHANNEL, job_id)
            pipe.execute()

    def append_end(self, job_id: str, event: dict[str, Any]) -> None:
        """Append an end event to the job's log (if no later event is there) and notify."""
        self.append_ends([(job_id, event)])

    def append_ends(self, ends: list[tuple[str, dict[str, Any]]], page: int = 1000) -> None:
        for start in range(0, len(ends), page):
            pipe = self._redis.pipeline(transaction=False)
            for job_id, event in ends[start : start + page]:
                pipe.xadd(job_stream(job_id), {"e": compact_bytes(event)}, id=event["id"])
                pipe.expire(job_stream(job_id), STREAM_EXPIRE_SECONDS)
                announce_end(pipe, job_id, event["id"])
            pipe.execute(raise_on_error=False)

    def announce_stream(self, job_id: str) -> None:
        """Tell the workers that a client is streaming the job from now on (`llmq:watch`):
        the one running it, if it was coalescing the job's chunks because nobody heard
        them, takes every step again from its next engine update, not its next flush."""
        self._redis.publish(WATCH_CHANNEL, job_id)

    def wait_for_end(self, job_id: str, is_done: Callable[[], bool], timeout: float) -> bool:
        """Block until the job ends or `timeout` seconds pass; True if it ended.

        Subscribes first (to the end alone: a waiter is not a hearer of the job's chunks),
        then asks `is_done` (Postgres), so an end published between the two is never missed.
        """
        pubsub = connections.pubsub(self._redis, ignore_subscribe_messages=True)
        try:
            pubsub.subscribe(end_channel(job_id))
            if is_done():
                return True
            deadline = time.monotonic() + timeout
            while (left := deadline - time.monotonic()) > 0:
                message = pubsub.get_message(timeout=min(left, 1.0))
                if message is not None and is_end_notification(message["data"]):
                    return True
            return is_done()
        finally:
            pubsub.close()
