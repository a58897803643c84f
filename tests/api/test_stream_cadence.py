"""The worker's stream publisher against real Redis: a job nobody listens to is coalesced
more coarsely once an announcement of it went unheard; a subscriber brings the live cadence
back at the next announcement, or at once when it is announced on `llmq:watch`; those who
wait for the end alone hear it on `llmq:end:<id>` without being counted; the log itself is
the same either way."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import pytest
import redis

from app.events import (
    EventId,
    JobEvents,
    carried_event,
    end_channel,
    end_event,
    is_end_notification,
    job_channel,
    job_stream,
)
from tests.helpers import Stores, next_message, wait_subscribers
from worker.control import SignalListener
from worker.streaming import StreamPublisher


@pytest.fixture
def publisher(stores: Stores) -> Iterator[StreamPublisher]:
    pub = StreamPublisher(
        redis.Redis.from_url(stores.redis_url),
        flush_tokens=8,
        flush_seconds=0.04,
        quiet_flush_tokens=256,
        quiet_flush_seconds=0.5,
    )
    pub.start()
    yield pub
    pub.stop()


def ship(pub: StreamPublisher, job_id: str, seq: int, *, final: bool = False) -> None:
    before = pub.published
    pub.submit(job_id, {"id": f"1-{seq}", "type": "chunk", "data": {"n": seq}}, final=final)
    deadline = time.monotonic() + 5
    while pub.published == before:
        assert time.monotonic() < deadline, "event not shipped"
        time.sleep(0.005)


def _logged(r: redis.Redis, job_id: str) -> list[str]:
    """The ids of the job's stream log as Redis has it."""
    return [eid.decode() for eid, _ in r.xrange(job_stream(job_id))]


def heard(sub: redis.client.PubSub) -> bool:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if sub.get_message(timeout=0.1) is not None:  # the subscribe confirmation is skipped
            return True
    return False


def test_unheard_job_is_quiet_and_live_again_once_heard(publisher: StreamPublisher, stores: Stores) -> None:
    job_id = f"job_{secrets.token_hex(4)}"
    publisher.open(job_id, 1, {"id": "chatcmpl-x", "created": 0, "model": "m"})  # type: ignore[arg-type]
    assert publisher.cadence(job_id) == (8, 0.04)  # nothing announced yet
    assert publisher.merge_seconds(job_id) == 0.0
    ship(publisher, job_id, 1)
    # Nobody heard it: coarser flushes, and the runner may take the engine's updates merged.
    assert publisher.cadence(job_id) == (256, 0.5)
    assert publisher.merge_seconds(job_id) == 0.1

    r = redis.Redis.from_url(stores.redis_url)
    sub = r.pubsub(ignore_subscribe_messages=True)
    sub.subscribe(job_channel(job_id))
    try:
        ship(publisher, job_id, 2)
        assert heard(sub), "the announcement did not reach the subscriber"
        assert publisher.cadence(job_id) == (8, 0.04)
        assert publisher.merge_seconds(job_id) == 0.0  # heard: every step as it comes
    finally:
        sub.close()
    ship(publisher, job_id, 3)
    assert publisher.cadence(job_id) == (256, 0.5)  # the subscriber left
    assert publisher.merge_seconds(job_id) == 0.1
    ship(publisher, job_id, 4, final=True)
    assert publisher.cadence(job_id) == (8, 0.04)  # forgotten once ended
    assert publisher.merge_seconds(job_id) == 0.0
    assert _logged(r, job_id) == ["1-1", "1-2", "1-3", "1-4"]


def test_a_stream_announced_on_the_watch_channel_is_live_before_the_next_flush(
    publisher: StreamPublisher, stores: Stores
) -> None:
    """A client who begins to stream an unheard job is announced on `llmq:watch`: the worker's
    signal listener takes the job out of the quiet set without waiting for a flush to be
    heard (which, at the quiet cadence, could be half a second away)."""
    r = redis.Redis.from_url(stores.redis_url)
    job_id = f"job_{secrets.token_hex(4)}"
    publisher.open(job_id, 1, {"id": "chatcmpl-x", "created": 0, "model": "m"})  # type: ignore[arg-type]
    ship(publisher, job_id, 1)
    assert publisher.merge_seconds(job_id) == 0.1
    runner = SimpleNamespace(cancel=lambda job_id: False)
    listener = SignalListener(r, runner, publisher.watched)  # type: ignore[arg-type]
    listener.start()
    try:
        # Published until the listener has subscribed (a message before that is lost).
        deadline = time.monotonic() + 5
        while publisher.merge_seconds(job_id) != 0.0:
            assert time.monotonic() < deadline, "the watch announcement never reached the publisher"
            JobEvents(r).announce_stream(job_id)
            time.sleep(0.05)
    finally:
        listener.stop()
    assert publisher.cadence(job_id) == (8, 0.04)
    assert _logged(r, job_id) == ["1-1"]  # no flush needed


def test_a_watch_is_applied_after_the_appends_shipped_with_it(stores: Stores) -> None:
    """An append shipped before the client subscribed answers "nobody heard" even when that
    answer is read after the watch came in: the watch, applied after the appends of its
    batch, wins, or the job would stay quiet until a later flush was heard."""
    publisher = StreamPublisher(redis.Redis.from_url(stores.redis_url))  # its thread not started
    job_id = f"job_{secrets.token_hex(4)}"
    publisher.open(job_id, 1, {"id": "chatcmpl-x", "created": 0, "model": "m"})  # type: ignore[arg-type]
    publisher._ship([(job_id, {"id": "1-1", "type": "chunk", "data": {}}, False)])
    assert publisher.merge_seconds(job_id) == 0.1
    publisher.watched(job_id)
    watch = publisher._queue.get_nowait()
    publisher._ship([watch, (job_id, {"id": "1-2", "type": "chunk", "data": {}}, False)])
    assert publisher.merge_seconds(job_id) == 0.0 and publisher.cadence(job_id) == (8, 0.04)
    assert publisher.published == 2  # events; the watch is not one
    publisher.watched("job_run_elsewhere")  # every worker hears it; only its runner acts
    assert publisher._queue.empty()


def test_a_job_is_told_heard_when_heard_or_watched_once_until_it_goes_unheard(stores: Stores) -> None:
    """`on_heard` (the runner's `hasten`, which brings a job's engine updates back to every
    other token) is told each running job the first time an announcement of it is heard or
    it is watched, once per attempt, and again when a client comes back after an
    announcement went unheard; never for one nobody heard, nor for one not running here."""
    r = redis.Redis.from_url(stores.redis_url)
    publisher = StreamPublisher(r)  # its thread not started: _ship runs here
    told: list[str] = []
    publisher.on_heard = told.append
    header = {"id": "chatcmpl-x", "created": 0, "model": "m"}
    heard_job, watched_job = f"job_{secrets.token_hex(4)}", f"job_{secrets.token_hex(4)}"
    publisher.open(heard_job, 1, header)  # type: ignore[arg-type]
    publisher.open(watched_job, 1, header)  # type: ignore[arg-type]
    publisher._ship([(heard_job, {"id": "1-1", "type": "chunk", "data": {}}, False)])
    assert told == []  # nobody heard it
    sub = r.pubsub(ignore_subscribe_messages=True)

    sub.subscribe(job_channel(heard_job))
    wait_subscribers(r, job_channel(heard_job), 1)
    try:
        for seq in (2, 3):
            publisher._ship([(heard_job, {"id": f"1-{seq}", "type": "chunk", "data": {}}, False)])
        assert told == [heard_job]  # heard twice, told once
        publisher.watched(watched_job)
        publisher.watched(watched_job)
        publisher._ship([publisher._queue.get_nowait(), publisher._queue.get_nowait()])
        assert told == [heard_job, watched_job]
        publisher.watched("job_run_elsewhere")
        assert publisher._queue.empty()
        # The client leaves (an announcement nobody hears) and comes back: told again.
        sub.unsubscribe()
        wait_subscribers(r, job_channel(heard_job), 0)
        publisher._ship([(heard_job, {"id": "1-4", "type": "chunk", "data": {}}, False)])
        assert told == [heard_job, watched_job]
        sub.subscribe(job_channel(heard_job))
        wait_subscribers(r, job_channel(heard_job), 1)
        for seq in (5, 6):
            publisher._ship([(heard_job, {"id": f"1-{seq}", "type": "chunk", "data": {}}, False)])
        assert told == [heard_job, watched_job, heard_job]
        # A new attempt is a new engine request: heard again, told again.
        publisher.open(heard_job, 2, header)  # type: ignore[arg-type]
        publisher._queue.get_nowait()  # its log's reset
        publisher._ship([(heard_job, {"id": "2-1", "type": "chunk", "data": {}}, False)])
        assert told == [heard_job, watched_job, heard_job, heard_job]
    finally:
        sub.close()

    def fails(job_id: str) -> None:
        raise RuntimeError("boom")

    publisher.on_heard = fails
    publisher.open(heard_job, 3, header)  # type: ignore[arg-type]
    reset = publisher._queue.get_nowait()
    publisher.watched(heard_job)
    publisher._ship([reset, publisher._queue.get_nowait()])  # the failure is logged, not raised
    assert publisher.merge_seconds(heard_job) == 0.0


def test_a_jobs_end_is_heard_on_its_end_channel_by_waiters_who_are_not_hearers(
    publisher: StreamPublisher, stores: Stores
) -> None:
    """Its last event is announced on `llmq:end:<id>` too, by its header: a synchronous
    answer's wait subscribes there, hears the end, and is not counted, so the job it waits
    for stays quiet; an end written from outside the worker (a cancel, the sweeper) reaches
    it the same way."""
    r = redis.Redis.from_url(stores.redis_url)
    job_id = f"job_{secrets.token_hex(4)}"
    publisher.open(job_id, 1, {"id": "chatcmpl-x", "created": 0, "model": "m"})  # type: ignore[arg-type]
    ends = r.pubsub(ignore_subscribe_messages=True)
    ends.subscribe(end_channel(job_id))
    try:
        ship(publisher, job_id, 1)
        ship(publisher, job_id, 2)
        assert publisher.cadence(job_id) == (256, 0.5)  # the end's waiter is not a hearer
        # but it is waiting: every step is taken, so an end at a stop token is seen at once
        assert publisher.merge_seconds(job_id) == 0.0
        assert next_message(ends, 0.3) is None  # nor told of chunks
        ship(publisher, job_id, 3, final=True)
        message = next_message(ends, 5)
        assert message is not None and message["data"] == b"1-3 end"
        outside = f"job_{secrets.token_hex(4)}"
        ends.subscribe(end_channel(outside))
        JobEvents(r).append_end(outside, end_event(1, "cancelled", None))
        message = next_message(ends, 5)
        assert message is not None and message["channel"] == end_channel(outside).encode()
        assert is_end_notification(message["data"])
    finally:
        ends.close()


def test_a_job_stream_flushes_by_the_publishers_cadence(publisher: StreamPublisher) -> None:
    """Fed one token at a time with nobody listening, a job's chunks carry many tokens each
    instead of one per flush interval."""
    from worker.engine import ChoiceDelta, EngineUpdate

    job_id = f"job_{secrets.token_hex(4)}"
    stream = publisher.open(job_id, 1, {"id": "chatcmpl-x", "created": 0, "model": "m"})  # type: ignore[arg-type]
    ship_wait = time.monotonic() + 5
    for i in range(200):
        stream.add(EngineUpdate([ChoiceDelta(0, "t", [i])], 1, 0, False))
        while stream.first_event_at is not None and publisher.published == 0:
            assert time.monotonic() < ship_wait
            time.sleep(0.005)
        time.sleep(0.001)
    stream.add(EngineUpdate([ChoiceDelta(0, "", [], finish_reason="length")], 1, 0, True))
    chunks = [e for e in stream.events if e.get("type") == "chunk"]
    assert "".join(e["data"]["choices"][0]["delta"].get("content", "") for e in chunks) == "t" * 200
    # Live cadence (8 tokens or 40 ms) would be 25 chunks or more; quiet is a handful.
    assert len(chunks) <= 5, len(chunks)


def test_a_discarded_job_is_forgotten_even_if_its_events_ship_later(publisher: StreamPublisher) -> None:
    """A job handed back or fenced off is discarded while its events may still be queued:
    shipping them does not mark it again (the set would grow for the worker's life)."""
    job_id = f"job_{secrets.token_hex(4)}"
    publisher.open(job_id, 1, {"id": "chatcmpl-x", "created": 0, "model": "m"})  # type: ignore[arg-type]
    ship(publisher, job_id, 1)
    assert publisher.cadence(job_id) == (256, 0.5)
    publisher.discard(job_id)
    ship(publisher, job_id, 2)
    assert publisher.cadence(job_id) == (8, 0.04)


def test_an_announcement_carries_its_event_as_the_log_holds_it(
    publisher: StreamPublisher, stores: Stores
) -> None:
    """`<event JSON>\\n<id>`, ` end` after the last id: a subscriber can keep the event without
    reading the log, and a reader of the header alone still sees the end."""
    job_id = f"job_{secrets.token_hex(4)}"
    publisher.open(job_id, 1, {"id": "chatcmpl-x", "created": 0, "model": "m"})  # type: ignore[arg-type]
    r = redis.Redis.from_url(stores.redis_url)
    sub = r.pubsub(ignore_subscribe_messages=True)
    sub.subscribe(job_channel(job_id))
    try:
        ship(publisher, job_id, 1)
        ship(publisher, job_id, 2, final=True)
        messages = []
        deadline = time.monotonic() + 5
        while len(messages) < 2 and time.monotonic() < deadline:
            message = sub.get_message(timeout=0.1)
            if message is not None:
                messages.append(message["data"])
    finally:
        sub.close()
    logged = {eid.decode(): fields[b"e"] for eid, fields in r.xrange(job_stream(job_id))}
    assert [carried_event(m) for m in messages] == [
        (EventId(1, 1), logged["1-1"]),
        (EventId(1, 2), logged["1-2"]),
    ]
    assert [is_end_notification(m) for m in messages] == [False, True]
    assert carried_event(b"1-3 end") is None  # an end written from outside: the id alone


def _script_exists_calls(r: redis.Redis) -> int:
    return int(r.info("commandstats").get("cmdstat_script|exists", {}).get("calls", 0))


def test_a_flush_is_one_round_trip_without_asking_redis_for_its_script(
    publisher: StreamPublisher, stores: Stores
) -> None:
    """The append goes as EVALSHA: a registered script queued in a redis-py pipeline would
    send SCRIPT EXISTS before every flush, a second round trip each time."""
    r = redis.Redis.from_url(stores.redis_url)
    job_id = f"job_{secrets.token_hex(4)}"
    publisher.open(job_id, 1, {"id": "chatcmpl-x", "created": 0, "model": "m"})  # type: ignore[arg-type]
    ship(publisher, job_id, 1)  # the script is loaded by now
    before = _script_exists_calls(r)
    for seq in range(2, 12):
        ship(publisher, job_id, seq)
    assert _script_exists_calls(r) == before
    assert len(r.xrange(job_stream(job_id))) == 11


def test_events_ship_after_redis_drops_its_scripts(publisher: StreamPublisher, stores: Stores) -> None:
    """SCRIPT FLUSH (or a restart that kept the data): the next flush loads the script again
    and every event lands once, announced."""
    r = redis.Redis.from_url(stores.redis_url)
    job_id = f"job_{secrets.token_hex(4)}"
    publisher.open(job_id, 1, {"id": "chatcmpl-x", "created": 0, "model": "m"})  # type: ignore[arg-type]
    ship(publisher, job_id, 1)
    r.script_flush()
    sub = r.pubsub(ignore_subscribe_messages=True)
    sub.subscribe(job_channel(job_id))
    try:
        ship(publisher, job_id, 2)
        assert heard(sub), "the announcement did not reach the subscriber"
    finally:
        sub.close()
    ship(publisher, job_id, 3, final=True)
    assert _logged(r, job_id) == ["1-1", "1-2", "1-3"]


def test_a_log_redis_lost_is_written_again_and_its_end_announced_on_both_channels(
    publisher: StreamPublisher, stores: Stores
) -> None:
    """Redis lost the stream (a restart without its data) before the job's last event: the
    worker writes the whole log again, with its expiry, and announces the end as the append
    would have, on the job's channel and on its end channel, where a synchronous answer
    waits."""
    r = redis.Redis.from_url(stores.redis_url)
    job_id = f"job_{secrets.token_hex(4)}"
    publisher.open(job_id, 1, {"id": "chatcmpl-x", "created": 0, "model": "m"})  # type: ignore[arg-type]
    ship(publisher, job_id, 1)
    r.delete(job_stream(job_id))
    channels = r.pubsub(ignore_subscribe_messages=True)
    channels.subscribe(job_channel(job_id), end_channel(job_id))
    try:
        assert next_message(channels, 0.3) is None  # both subscriptions confirmed
        publisher.submit(job_id, {"id": "1-2", "type": "end", "status": "succeeded"}, final=True)
        got = {}
        while len(got) < 2 and (message := next_message(channels, 5)) is not None:
            got[message["channel"]] = message["data"]
    finally:
        channels.close()
    assert got == {job_channel(job_id).encode(): b"1-2 end", end_channel(job_id).encode(): b"1-2 end"}
    assert _logged(r, job_id) == ["1-1", "1-2"]
    assert 0 < r.ttl(job_stream(job_id)) <= 3600


def _until(check: Callable[[], bool], seconds: float = 5.0) -> float:
    """Seconds until `check()` held (fails after `seconds`)."""
    start = time.monotonic()
    while not check():
        assert time.monotonic() - start < seconds, "never happened"
        time.sleep(0.005)
    return time.monotonic() - start


def test_events_nobody_hears_gather_and_ship_together_while_others_ship_at_once(
    publisher: StreamPublisher, stores: Stores
) -> None:
    """A job whose latest announcement nobody heard: its next events wait up to the gather
    time for each other (one round trip, no wake-up each); an event of a job that may be
    heard, or a job's last, ends the wait at once and takes them along."""
    r = redis.Redis.from_url(stores.redis_url)
    publisher.quiet_gather_seconds = 1.5
    quiet, other = f"job_{secrets.token_hex(4)}", f"job_{secrets.token_hex(4)}"
    for job_id in (quiet, other):
        publisher.open(job_id, 1, {"id": "chatcmpl-x", "created": 0, "model": "m"})  # type: ignore[arg-type]
    ship(publisher, quiet, 1)  # its first event goes at once; nobody heard it
    assert publisher.merge_seconds(quiet) > 0

    for seq in (2, 3):
        publisher.submit(quiet, {"id": f"1-{seq}", "type": "chunk", "data": {"n": seq}})
    time.sleep(0.3)
    assert _logged(r, quiet) == ["1-1"], "quiet events shipped before their gather time"
    # Another job's first event (somebody may be listening) is not held: the quiet ones
    # go with it.
    publisher.submit(other, {"id": "1-1", "type": "chunk", "data": {}})
    assert _until(lambda: _logged(r, other) == ["1-1"]) < 1.0
    assert _logged(r, quiet) == ["1-1", "1-2", "1-3"]

    # Left alone, quiet events ship once the gather time has passed.
    publisher.submit(quiet, {"id": "1-4", "type": "chunk", "data": {}})
    assert 1.0 < _until(lambda: len(_logged(r, quiet)) == 4) < 4.0

    # A job's last event is never held, nor are the quiet events before it.
    publisher.submit(quiet, {"id": "1-5", "type": "chunk", "data": {}})
    publisher.submit(quiet, {"id": "1-6", "type": "end", "status": "succeeded"}, final=True)
    assert _until(lambda: len(_logged(r, quiet)) == 6) < 1.0
