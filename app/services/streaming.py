"""Reading a job's event log: the SSE generator for live subscribers, the recorded stream,
and waiting for a job's end. Framing is in app/services/sse.py, the shared pub/sub in
app/services/notifier.py.

The backlog comes from the Redis Stream (or, once it has expired or was lost, from the
events persisted with the job in Postgres); live events arrive through one shared pub/sub
connection per process (`Notifier`), so an idle subscriber holds no Redis connection and,
under gevent, no thread.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from redis import Redis
from redis.exceptions import RedisError
from sqlalchemy.exc import SQLAlchemyError

from app.completions import usage_chunk
from app.db import Database
from app.domain.status import JobKind, JobStatus
from app.errors import Unauthorized, error_object
from app.events import (
    END_EVENT,
    EventId,
    JobEvents,
    end_event,
    job_stream,
    parse_event_id,
)
from app.models import Job
from app.schemas.completion import RecordedStream
from app.schemas.jobs import JobObject
from app.services.feeds import FeedRead, JobFeed, event_id, read_events
from app.services.jobs import job_status
from app.services.keys import KeyService, Principal
from app.services.notifier import Notifier
from app.services.ownership import load_owned, not_owned
from app.services.sse import DONE, HEARTBEAT, frame, restarted, revoked
from app.text_completions import text_usage_chunk

log = logging.getLogger("llmq.stream")

# About how much of a stream's backlog one write carries (characters of SSE text).
PIECE_CHARS = 64 * 1024


@dataclass
class JobView:
    id: str
    status: str
    epoch: int
    model: str
    created: int
    usage: dict[str, Any] | None
    error: dict[str, Any] | None
    events: list[dict[str, Any]] | None
    include_usage: bool
    kind: str = JobKind.CHAT.value

    @property
    def terminal(self) -> bool:
        return JobStatus(self.status).terminal


_TERMINAL_ERRORS = {
    JobStatus.CANCELLED.value: ("the job was cancelled", "cancelled", "job_cancelled"),
    JobStatus.EXPIRED.value: ("the job expired before it finished", "expired", "job_expired"),
}


class KeyWatch:
    """Whether a key may still stream. Postgres is asked at most once per `interval` per
    key in this process, however many streams the key holds open."""

    def __init__(self, keys: KeyService, interval: float) -> None:
        self._keys = keys
        self._interval = interval
        self._lock = threading.Lock()
        self._seen: dict[str, tuple[float, bool]] = {}

    def valid(self, key_id: str) -> bool:
        now = time.monotonic()
        with self._lock:
            seen = self._seen.get(key_id)
            if seen is not None and now - seen[0] < self._interval:
                return seen[1]
        try:
            valid = key_id in self._keys.active([key_id])
        except SQLAlchemyError as exc:
            # The database is busy or away: keep the stream; the next check asks again.
            log.warning("key check failed", extra={"error": type(exc).__name__})
            return True
        with self._lock:
            if len(self._seen) > 10_000:
                self._seen = {k: v for k, v in self._seen.items() if now - v[0] < self._interval}
            self._seen[key_id] = (now, valid)
        return valid


class StreamService:
    def __init__(
        self,
        db: Database,
        redis: Redis[bytes],
        notifier: Notifier,
        keys: KeyService,
        *,
        heartbeat_seconds: float = 15.0,
        key_check_seconds: float = 5.0,
    ) -> None:
        self._db = db
        self._redis = redis
        self._notifier = notifier
        self._heartbeat = heartbeat_seconds
        self._key_check = key_check_seconds
        self._key_watch = KeyWatch(keys, key_check_seconds)
        self._events = JobEvents(redis)

    def close(self) -> None:
        self._notifier.close()

    def _announce(self, job_id: str) -> None:
        """Tell the workers this job is streamed now (its subscription is confirmed, so the
        next flush is heard anyway): one that was coalescing its chunks stops at its next
        engine update. Without Redis the stream reads Postgres, and no worker can hear."""
        with contextlib.suppress(RedisError):
            self._events.announce_stream(job_id)

    # --- reads -------------------------------------------------------------------------

    def _status(self, principal: Principal, job_id: str) -> str:
        """Raises NotFound: the tenant has no such job."""
        status = job_status(self._db, job_id, principal.tenant_id)
        if status is None:
            raise not_owned(Job, job_id)
        return status

    def _view(self, principal: Principal, job_id: str) -> JobView:
        with self._db.reading() as s:
            job = load_owned(s, Job, job_id, principal.tenant_id)
            options = (job.request or {}).get("stream_options") or {}
            return JobView(
                id=job.id,
                status=job.status,
                epoch=job.epoch,
                model=job.model,
                created=int(job.created_at.timestamp()),
                usage=job.usage,
                error=(job.error or {}).get("error") if job.error else None,
                events=job.events,
                include_usage=bool(options.get("include_usage")),
                kind=job.kind,
            )

    def _view_now(self, principal: Principal, view: JobView) -> JobView | None:
        """The job as Postgres has it now; None when Postgres cannot answer this moment
        (pool exhausted, connection lost): an open stream waits and asks again."""
        try:
            return self._view(principal, view.id)
        except SQLAlchemyError as exc:
            log.warning(
                "stream could not read its job", extra={"job_id": view.id, "error": type(exc).__name__}
            )
            return None

    def _shared_view(self, feed: JobFeed, principal: Principal, view: JobView) -> JobView | None:
        """`_view_now`, shared with the job's other streams in this process for half a
        heartbeat: a lost end event is still found within a heartbeat and a half."""
        return feed.looked_up(lambda: self._view_now(principal, view), self._heartbeat / 2)

    def _from_redis(self, job_id: str, after: EventId | None) -> tuple[list[dict[str, Any]], bool]:
        """Events after `after`, and whether the stream exists at all."""
        return read_events(self._redis, job_stream(job_id), after)

    @staticmethod
    def _from_postgres(view: JobView, after: EventId | None) -> list[dict[str, Any]]:
        events = list(view.events or [])
        if not events or events[-1].get("type") != END_EVENT:
            error = _error_for(view)
            events.append(end_event(view.epoch, view.status, error, view.usage))
        return [e for e in events if after is None or event_id(e) > after]

    # --- SSE -----------------------------------------------------------------------------

    def open_stream(
        self,
        principal: Principal,
        job_id: str,
        last_event_id: str | None,
        *,
        include_usage: bool | None = None,
    ) -> Iterator[str]:
        """Validate now (404, bad Last-Event-ID), then return the SSE body generator.
        Opening uses one short database session; the stream holds none."""
        view = self._view(principal, job_id)
        cursor = parse_event_id(last_event_id)
        usage_wanted = view.include_usage if include_usage is None else include_usage
        return self._sse(principal, view, cursor, usage_wanted)

    def open_submitted(
        self, principal: Principal, job: JobObject, kind: JobKind, *, include_usage: bool
    ) -> Iterator[str]:
        """The stream of a job this request has just submitted (`stream: true`): the job as
        the submit returned it is the stream's first view, so opening reads nothing (64
        streamed requests arriving together each read their new job back, a fifth of the
        API's CPU for them). A job an idempotency key replayed that has run since is read
        as any stream's."""
        if job.status != JobStatus.QUEUED or job.epoch != 0:
            return self.open_stream(principal, job.id, None, include_usage=include_usage)
        view = JobView(
            id=job.id,
            status=job.status.value,
            epoch=job.epoch,
            model=job.model,
            created=job.created_at,
            usage=None,
            error=None,
            events=None,
            include_usage=include_usage,
            kind=kind.value,
        )
        return self._sse(principal, view, None, include_usage)

    def _sse(
        self, principal: Principal, view: JobView, cursor: EventId | None, include_usage: bool
    ) -> Iterator[str]:
        with self._notifier.watch(view.id) as waiter:
            if not view.terminal:
                self._announce(view.id)
            epoch = cursor.epoch if cursor else None
            from_postgres = False
            # `view` was read from Postgres as the stream opened: the first look there is
            # that read, not another (a burst of streams on a queued job, whose Redis stream
            # does not exist yet, cost two reads each).
            fresh: JobView | None = view
            now = time.monotonic()
            next_heartbeat, next_key_check = now + self._heartbeat, now + self._key_check
            while True:
                if time.monotonic() >= next_key_check:
                    # A revoked key's stream stops, even while events keep flowing.
                    if not self._key_watch.valid(principal.key_id):
                        yield from revoked()
                        return
                    next_key_check = time.monotonic() + self._key_check
                events: list[dict[str, Any]] = []
                if not from_postgres:
                    try:
                        read = waiter.feed.after(cursor)
                    except RedisError:
                        read = FeedRead([], False, None)
                    if read.ended_at_or_before(cursor):
                        # A resume at or past the end event: nothing is left to send.
                        yield DONE
                        return
                    events = read.events
                    from_postgres = not events and not read.exists
                if from_postgres:
                    latest = fresh or self._shared_view(waiter.feed, principal, view)
                    if latest is not None:
                        view = latest
                        from_postgres = False
                        if view.terminal:
                            events = self._from_postgres(view, cursor)
                            if not events:  # resumed at or past the recorded end
                                yield DONE
                                return
                fresh = None
                # The events read at once go out as one piece: one write to the socket, not
                # one each (a stream that falls behind catches up in fewer, larger writes).
                # A long backlog goes in pieces of PIECE_CHARS or so, so that a stream
                # holds no more than that beyond the process's copy of the log.
                out: list[str] = []
                held = 0
                for event in events:
                    eid = event_id(event)
                    if epoch is not None and eid.epoch > epoch and event.get("type") != END_EVENT:
                        out.extend(restarted(eid))
                        yield "".join(out)
                        return
                    epoch, cursor = eid.epoch, eid
                    if event.get("type") == END_EVENT:
                        out.extend(self._final(view, event, include_usage))
                        yield "".join(out)
                        return
                    out.append(frame(event["data"], str(eid)))
                    held += len(out[-1])
                    if held >= PIECE_CHARS:
                        yield "".join(out)
                        out, held = [], 0
                if out:
                    yield "".join(out)
                if events:
                    next_heartbeat = time.monotonic() + self._heartbeat
                    continue
                wake_at = min(next_heartbeat, next_key_check)
                if waiter.wait(max(0.0, wake_at - time.monotonic())):
                    continue
                if time.monotonic() >= next_heartbeat:
                    yield HEARTBEAT
                    next_heartbeat = time.monotonic() + self._heartbeat
                    # Quiet for a whole heartbeat: if the job ended without its end event
                    # reaching Redis, Postgres has the rest.
                    latest = self._shared_view(waiter.feed, principal, view)
                    from_postgres = from_postgres or (latest is not None and latest.terminal)

    def _final(self, view: JobView, event: dict[str, Any], include_usage: bool) -> Iterator[str]:
        eid = str(event["id"])
        if include_usage and event.get("usage"):
            build = text_usage_chunk if view.kind == JobKind.COMPLETION.value else usage_chunk
            yield frame(build(view.id, view.created, view.model, event["usage"]), eid)
        error = event.get("error") or _error_for_status(event.get("status", ""))
        if error:
            yield frame({"error": error}, eid)
        yield DONE

    # --- recorded stream and waiting -----------------------------------------------------

    def recorded(self, principal: Principal, job_id: str) -> dict[str, Any]:
        """Seed 002's shape: every chunk so far, and the usage once the job has ended."""
        view = self._view(principal, job_id)
        if view.terminal:
            events = self._from_postgres(view, None)
        else:
            events, _ = self._from_redis(job_id, None)
        chunks = [e["data"] for e in events if e.get("type") == "chunk"]
        recorded = RecordedStream.model_validate(
            {"events": chunks, "usage": view.usage if view.terminal else None}
        )
        return recorded.model_dump(mode="json")

    def wait_for_end(self, principal: Principal, job_id: str, timeout: float) -> bool:
        """True once the job is terminal; False if `timeout` passed first. Waits on the
        notifier; Postgres is asked only on an end notification or once a heartbeat.

        Raises:
            Unauthorized: the caller's key was revoked while waiting.
        """
        deadline = time.monotonic() + timeout
        # The end alone: a synchronous caller reads no chunk, so it does not keep the job's
        # chunks at the live cadence (worker/streaming.py), nor is it woken by each of them.
        with self._notifier.watch(job_id, end_only=True) as waiter:
            ask_at = 0.0
            while True:
                now = time.monotonic()
                if waiter.ended or now >= ask_at:
                    if JobStatus(self._status(principal, job_id)).terminal:
                        return True
                    ask_at = now + self._heartbeat
                if not self._key_watch.valid(principal.key_id):
                    raise Unauthorized("the API key was revoked")
                left = deadline - now
                if left <= 0:
                    return False
                waiter.wait(min(left, ask_at - now, self._key_check))


def _error_for_status(status: str) -> dict[str, Any] | None:
    if status in _TERMINAL_ERRORS:
        message, kind, code = _TERMINAL_ERRORS[status]
        return error_object(message, kind, code=code)
    return None


def _error_for(view: JobView) -> dict[str, Any] | None:
    return view.error or _error_for_status(view.status)
