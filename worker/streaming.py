"""Job events to Redis: shipped by one thread in pipelined round trips (the transport;
shaping deltas into chunks is worker/deltas.py).

Each job's events go to the Redis Stream `llmq:events:<job_id>` with explicit ids
`<epoch>-<seq>` (so ids grow across attempts and double as SSE ids), and each append is
announced on the pub/sub channel `llmq:job:<job_id>` with the event itself, so the API's
subscribers need not read it back. Deltas reach it coalesced (one event
per `flush_tokens` tokens or `flush_seconds`), so Redis work grows with streams, not tokens.

Most jobs have nobody watching (a batch line, a job that is polled or answered
synchronously, whose waiter listens for the end alone on `llmq:end:<id>`): PUBLISH answers
how many subscribers heard each announcement, and once nobody heard a job's latest one, its
deltas are coalesced per `quiet_flush_tokens` or `quiet_flush_seconds` instead, until
somebody does. A client who begins to stream the job later reads the log so far at once
and is announced on `llmq:watch` (app/events.py) as its subscription is confirmed:
`watched` takes the job out of the quiet set, in order with the appends already shipped,
so the live cadence resumes from the engine's next update, not from the next quiet flush.
One subscribed before the job starts (`stream: true`) hears its first event.

While nobody hears a job's latest announcement and nobody waits for its end (the append
answers how many wait on `llmq:end:<id>`), its runner takes the engine's updates at most
every `quiet_merge_seconds` (`merge_seconds`): vLLM merges the steps in between into one
update, so a job nobody watches costs the worker one wake-up per merge instead of one per
token (B1's 64 jobs of 256 tokens: the worker's CPU per job 19.8 -> 16.1 ms, rounds
alternating in one stack). A subscriber who comes is heard at the job's next flush, or
announced before it, and from then on every step is taken. Such a job that ends at a stop
token may be stored up to that long after the engine ended it (its engine slot is free at
once; one that runs to `max_tokens` is taken as it ends); a job somebody waits for (a
synchronous answer) takes every step, so its end is answered as it comes.

A job not submitted with `stream: true` also reaches the worker in updates of
`LLMQ_QUIET_STREAM_INTERVAL` tokens (vLLM's `stream_interval`: its per-step output is most
of what a job costs the worker beyond the engine); when an announcement of it is heard or
it is watched (the first time, and again after one went unheard), `on_heard` (the runner's
`hasten`) has the engine give it every other token from then on and ends the runner's merge
wait.

Such a job's later events are also gathered: the shipping thread holds one for up to
`quiet_gather_seconds`, so that what every quiet job flushes meanwhile goes in the same
round trip, and the job threads queueing them never wake it. An event somebody may hear
(a job not known to be unheard, or one's last event) ends the wait at once and takes the
gathered ones along, so a watched stream is never held back by quiet ones.

The worker keeps every event of a running job; if Redis restarts (and loses the stream),
the publisher writes the whole history again once it reconnects.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from app.completions import ChunkHeader
from app.events import END_EVENT, announce_end, end_channel, job_channel, job_stream, notification
from app.jsontext import compact_bytes
from app.threads import name_native_thread
from worker.deltas import JobStream

log = logging.getLogger("llmq.stream")

# A queued item saying a client began to stream the job (`StreamPublisher.watched`).
_WATCHED: dict[str, Any] = {"watched": True}


# Append one event unless the stream should exist and does not (Redis restarted and lost
# it): then answer 0 and append nothing, so no reader ever sees a log with a hole in it.
# Otherwise announce it, carrying the event (`<payload>\n<notification>`, app/events.py),
# and answer {1 + the number of subscribers that heard the announcement, the number waiting
# for the job's end on KEYS[3] (`llmq:end:<id>`)}. The last event (the one given an expiry)
# is announced there too, by its header alone: those who wait for the end only are not
# counted among the job's hearers.
# KEYS: stream, channel, end channel. ARGV: id, payload, maxlen, must_exist, notification,
# expire (0: not the last event).
_APPEND = """
if ARGV[4] == '1' and redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[3], ARGV[1], 'e', ARGV[2])
local heard = redis.call('PUBLISH', KEYS[2], ARGV[2] .. '\\n' .. ARGV[5])
if ARGV[6] == '0' then return {1 + heard, redis.call('PUBSUB', 'NUMSUB', KEYS[3])[2]} end
redis.call('EXPIRE', KEYS[1], ARGV[6])
return {1 + heard, redis.call('PUBLISH', KEYS[3], ARGV[5])}
"""


def _command(*args: bytes) -> bytes:
    """One command as Redis reads it (RESP: an array of bulk strings)."""
    return b"*%d\r\n%b" % (len(args), b"".join(b"$%d\r\n%b\r\n" % (len(a), a) for a in args))


class StreamPublisher:
    """The one thread that writes job events to Redis."""

    def __init__(
        self,
        redis: Redis[bytes],
        *,
        flush_tokens: int = 8,
        flush_seconds: float = 0.04,
        quiet_flush_tokens: int = 256,
        quiet_flush_seconds: float = 0.5,
        quiet_merge_seconds: float = 0.1,
        quiet_gather_seconds: float = 0.05,
        max_len: int = 100_000,
        expire_seconds: int = 3600,
    ) -> None:
        if expire_seconds < 1:
            raise ValueError("expire_seconds must be at least 1: the append tells a job's last event by it")
        self._redis = redis
        self.flush_tokens = flush_tokens
        self.flush_seconds = flush_seconds
        self.quiet_flush_tokens = quiet_flush_tokens
        self.quiet_flush_seconds = quiet_flush_seconds
        self.quiet_merge_seconds = quiet_merge_seconds
        self.quiet_gather_seconds = quiet_gather_seconds
        # Jobs whose latest announcement nobody heard, and jobs somebody waits to see end
        # (written by the shipping thread, read on the engine's: a stale answer only delays
        # one flush).
        self._unheard: set[str] = set()
        self._awaited: set[str] = set()
        # Running jobs somebody streams (an announcement heard, or `llmq:watch`), each told
        # to `on_heard` (the runner's `hasten`) as it comes to be, on this thread: once, and
        # again after an announcement of it went unheard.
        self._heard: set[str] = set()
        self.on_heard: Callable[[str], None] | None = None
        self._max_len = str(max_len).encode()
        self._expire = str(expire_seconds).encode()
        self._queue: queue.SimpleQueue[tuple[str, dict[str, Any], bool] | None] = queue.SimpleQueue()
        # Set when an event somebody may be waiting for is queued: it ends a gathering.
        self._urgent = threading.Event()
        self._history: dict[str, list[dict[str, Any]]] = {}
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="llmq-stream-publisher", daemon=True)
        self._append_sha = hashlib.sha1(_APPEND.encode()).hexdigest().encode()  # noqa: S324 - Redis's script id
        self.published = 0

    def open(self, job_id: str, epoch: int, header: ChunkHeader, *, n: int = 1) -> JobStream:
        """A new attempt starts a clean log: an older attempt's events are dropped."""
        with self._lock:
            self._history[job_id] = []
            self._heard.discard(job_id)
        if epoch > 1:
            self._queue.put((job_id, {"reset": True}, False))
            self._urgent.set()
        return JobStream(self, job_id, epoch, header, n=n)

    def cadence(self, job_id: str) -> tuple[int, float]:
        """(tokens, seconds) to coalesce a job's deltas over: quieter while nobody heard
        its latest announcement."""
        if job_id in self._unheard:
            return self.quiet_flush_tokens, self.quiet_flush_seconds
        return self.flush_tokens, self.flush_seconds

    def merge_seconds(self, job_id: str) -> float:
        """`quiet_merge_seconds` while nobody heard the job's latest announcement nor waits
        for its end, else 0: a watched job takes every step as it comes, and an awaited one
        too, so that an end at a stop token is seen (and answered) as it comes, not up to
        a merge later."""
        if job_id in self._unheard and job_id not in self._awaited:
            return self.quiet_merge_seconds
        return 0.0

    def watched(self, job_id: str) -> None:
        """A client began to stream the job (`llmq:watch`): live cadence again. Queued, so
        it is applied after every append shipped before it, whose answer (nobody heard:
        sent before the client subscribed) would otherwise put the job back. Every worker
        hears every announcement: one not running the job ignores it."""
        if job_id not in self._history:
            return
        self._queue.put((job_id, _WATCHED, False))
        self._urgent.set()

    def submit(self, job_id: str, event: dict[str, Any], *, final: bool = False) -> None:
        with self._lock:
            history = self._history.get(job_id)
            if history is not None:
                history.append(event)
        self._queue.put((job_id, event, final))
        if self._may_be_heard(job_id, final):
            self._urgent.set()

    def _may_be_heard(self, job_id: str, final: bool) -> bool:
        """Whether somebody may be waiting for this event now: a job not known to be
        unheard, or any job's last. Such an event is never held to gather others."""
        return final or job_id not in self._unheard

    def discard(self, job_id: str) -> None:
        """Forget a job whose result was refused by the fence (another worker owns it)."""
        with self._lock:
            self._history.pop(job_id, None)
            self._unheard.discard(job_id)
            self._awaited.discard(job_id)
            self._heard.discard(job_id)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._queue.put(None)
        self._urgent.set()
        self._thread.join(timeout)

    def _drain(
        self, first: tuple[str, dict[str, Any], bool]
    ) -> tuple[list[tuple[str, dict[str, Any], bool]], bool]:
        batch = [first]
        stopping = False
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is None:
                stopping = True
                break
            batch.append(item)
        return batch, stopping

    def _loop(self) -> None:
        name_native_thread()
        stopping = False
        while not stopping:
            item = self._queue.get()
            if item is None:
                return
            if self.quiet_gather_seconds and not self._may_be_heard(item[0], item[2]):
                # Nobody hears this job: its event waits with whatever else comes meanwhile
                # (not waking this thread), unless one that somebody may hear comes first.
                self._urgent.wait(self.quiet_gather_seconds)
            self._urgent.clear()
            batch, stopping = self._drain(item)
            self._ship_with_retry(batch)

    def _ship_with_retry(self, batch: list[tuple[str, dict[str, Any], bool]]) -> None:
        delay = 0.2
        while True:
            try:
                self._ship(batch)
                return
            except (RedisConnectionError, RedisTimeoutError) as exc:
                log.warning("redis unavailable; stream events held", extra={"error": type(exc).__name__})
                time.sleep(delay)
                delay = min(delay * 2, 5.0)

    def _ship(self, batch: list[tuple[str, dict[str, Any], bool]]) -> None:
        watched = [job_id for job_id, event, _ in batch if event is _WATCHED]
        if watched:
            batch = [item for item in batch if item[1] is not _WATCHED]
        heard = self._append(batch) if batch else []
        # After the appends before them, whose answers predate the client's subscription;
        # those shipped with or after them are heard.
        self._unheard.difference_update(watched)
        with self._lock:
            heard.extend(job_id for job_id in watched if self._newly_heard(job_id))
        if heard and self.on_heard is not None:
            for job_id in heard:
                try:
                    self.on_heard(job_id)
                except Exception:  # a stream's cadence is not worth this thread
                    log.exception("could not hasten a streamed job", extra={"job_id": job_id})

    def _newly_heard(self, job_id: str) -> bool:
        """Whether somebody streaming the running `job_id` is news for `on_heard` (marked
        told). Under `_lock`."""
        if job_id not in self._history or job_id in self._heard:
            return False
        self._heard.add(job_id)
        return True

    def _append(self, batch: list[tuple[str, dict[str, Any], bool]]) -> list[str]:
        """Ship the batch; the running jobs newly heard (`_newly_heard`)."""
        appended = [(job_id, final) for job_id, event, final in batch if not event.get("reset")]
        results = self._send(batch)
        if any(isinstance(r, NoScriptError) for r in results):
            # Redis lost its scripts (a restart, SCRIPT FLUSH): load it and send the batch
            # again. A reset runs again before its appends; an append that did run (a flush
            # between two of them) is refused as stale and dropped below.
            self._redis.execute_command("SCRIPT", "LOAD", _APPEND)
            results = self._send(batch)
        outcomes = [r for (_, event, _), r in zip(batch, results, strict=True) if not event.get("reset")]
        lost: set[str] = set()
        newly_heard: list[str] = []
        for (job_id, final), result in zip(appended, outcomes, strict=True):
            if isinstance(result, ResponseError):
                # An id at or below the stream's last one: this attempt was superseded (a
                # newer attempt or an external end event owns the log). Drop, never retry.
                log.info("stale stream event dropped", extra={"job_id": job_id, "error": str(result)})
            elif isinstance(result, Exception):
                raise result
            elif result == 0:
                lost.add(job_id)
            else:
                heard, awaited = result
                with self._lock:  # only while it runs here: not ended, handed back or discarded
                    running = job_id in self._history and not final
                    if running and heard == 1:
                        self._unheard.add(job_id)
                        self._heard.discard(job_id)  # a client who comes back is told again
                    else:
                        self._unheard.discard(job_id)
                    if running and heard > 1 and self._newly_heard(job_id):
                        newly_heard.append(job_id)
                    if running and awaited:
                        self._awaited.add(job_id)
                    else:
                        self._awaited.discard(job_id)
        if lost:
            self._restore(lost)
        self.published += len(batch)
        for job_id, final in appended:
            if final:
                with self._lock:
                    self._history.pop(job_id, None)
                    self._unheard.discard(job_id)
                    self._awaited.discard(job_id)
                    self._heard.discard(job_id)
        return newly_heard

    def _send(self, batch: list[tuple[str, dict[str, Any], bool]]) -> list[Any]:
        """The batch's commands in one round trip; their results, errors included. The
        append goes as a plain EVALSHA (a registered script makes redis-py ask SCRIPT EXISTS
        first, a second round trip for every flush), packed here: every argument is made
        bytes once, without redis-py's packer and pipeline, which a fixed command does not
        need (64-event batches: 18-25 -> 10 µs of this thread's CPU an event; every line of
        a batch, watched or not, logs its events)."""
        commands = []
        for job_id, event, final in batch:
            key = job_stream(job_id).encode()
            if event.get("reset"):
                commands.append(_command(b"DEL", key))
                continue
            event_id = event["id"]
            commands.append(
                _command(
                    b"EVALSHA",
                    self._append_sha,
                    b"3",
                    key,
                    job_channel(job_id).encode(),
                    end_channel(job_id).encode(),
                    event_id.encode(),
                    compact_bytes(event),
                    self._max_len,
                    b"0" if event_id.endswith("-1") else b"1",
                    notification(event_id, final=final).encode(),
                    self._expire if final else b"0",
                )
            )
        return self._round_trip(commands)

    def _round_trip(self, commands: list[bytes]) -> list[Any]:
        """Packed commands in one write, then every reply; an error reply stands in its
        command's place (a pipeline's `raise_on_error=False`). A connection that fails is
        dropped, never reused with replies unread; the caller sends the batch again."""
        pool = self._redis.connection_pool
        connection = pool.get_connection()
        try:
            connection.send_packed_command([b"".join(commands)])
            replies: list[Any] = []
            for _ in commands:
                try:
                    replies.append(connection.read_response())
                except ResponseError as exc:
                    replies.append(exc)
            return replies
        except BaseException:
            connection.disconnect()
            raise
        finally:
            pool.release(connection)

    def _restore(self, job_ids: set[str]) -> None:
        """The stream was gone when its next event came (Redis restarted without its data):
        write the attempt's whole log again, so a client resuming mid-stream finds it. When
        the event that found it gone was the job's last, the log ends as the append would
        have ended it: with its expiry, and the end announced on both channels (a
        synchronous answer waits on the end channel)."""
        with self._lock:
            snapshot = {j: list(self._history.get(j, [])) for j in job_ids}
        pipe = self._redis.pipeline(transaction=False)
        for job_id, events in snapshot.items():
            if not events:
                continue
            key = job_stream(job_id)
            pipe.delete(key)
            for event in events:
                pipe.xadd(key, {"e": compact_bytes(event)}, id=event["id"])
            last = events[-1]
            if last.get("type") == END_EVENT:
                pipe.expire(key, int(self._expire))
                announce_end(pipe, job_id, last["id"])
            else:
                pipe.publish(job_channel(job_id), last["id"])
        pipe.execute(raise_on_error=False)
        log.warning("stream logs rebuilt after Redis lost them", extra={"jobs": len(snapshot)})
