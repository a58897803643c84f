"""What llmq's Redis-touching pieces promise, written once and run twice: against fakeredis
in the `unit` tier (no server) and against the real Redis in the `api` tier, so a place
where the two differ shows up as a test that passes in one tier and fails in the other.

A module that collects these defines a fixture `r`: a client on an empty database.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest
from redis import Redis

from app.errors import Conflict, RateLimited
from app.events import JobEvents, end_event, job_channel, job_stream
from app.liveness import SENT_MARKER, UNACKED, UNACKED_INDEX, Liveness
from app.queue import JobQueue, create_producer
from app.services.idempotency import IdempotencyKey, IdempotencyLocks
from app.services.limits import RateLimiter
from app.settings import Settings
from worker.leader import LeaseLock


def _unacked_message(task: str, args: list[Any]) -> bytes:
    """A delivery as kombu's Redis transport stores it in `unacked` (see
    tests/api/test_kombu_contract.py for the check against real kombu)."""
    body = json.dumps([args, {}, {}])
    return json.dumps(
        [{"body": body, "headers": {"task": task}, "properties": {"body_encoding": "utf-8"}}, "", "q"]
    ).encode()


# --- rate limiter -----------------------------------------------------------------------


def test_rate_limiter_allows_the_burst_then_refuses_with_a_wait(r: Redis[bytes]) -> None:
    limiter = RateLimiter(r, per_minute=60, burst=3)
    for _ in range(3):
        limiter.check("key_a")
    with pytest.raises(RateLimited) as caught:
        limiter.check("key_a")
    assert 0 < caught.value.retry_after <= 1.0
    limiter.check("key_b")  # another key has its own bucket


def test_rate_limiter_refills_over_time(r: Redis[bytes]) -> None:
    limiter = RateLimiter(r, per_minute=6000, burst=1)  # 100 per second
    limiter.check("key_a")
    deadline = time.monotonic() + 2
    while True:
        try:
            limiter.check("key_a")
            break
        except RateLimited:
            assert time.monotonic() < deadline, "the bucket never refilled"
            time.sleep(0.005)
    assert r.ttl("llmq:rate:key_a") > 0  # idle buckets expire


# --- lease lock -------------------------------------------------------------------------


def test_lease_lock_has_one_holder_and_releases_only_its_own(r: Redis[bytes]) -> None:
    first = LeaseLock(r, "sweeper", "w1", lease_seconds=5)
    second = LeaseLock(r, "sweeper", "w2", lease_seconds=5)
    with first.hold() as mine, second.hold() as theirs:
        assert mine and not theirs
    with second.hold() as theirs:
        assert theirs
        r.set("llmq:leader:sweeper", "w3")  # w2's lease ran out and w3 took over
    assert r.get("llmq:leader:sweeper") == b"w3"  # w2's release left w3's lock alone


def test_a_turn_goes_to_the_first_to_ask_in_each_period(r: Redis[bytes]) -> None:
    """A round the fleet needs once a period (the sweeper's look for gone workers): the
    first worker to ask has it, the others (and the same worker again) not until the
    period has passed."""
    first = LeaseLock(r, "turns", "w1", lease_seconds=5)
    second = LeaseLock(r, "turns", "w2", lease_seconds=5)
    assert first.turn("look", 0.3)
    assert not second.turn("look", 0.3) and not first.turn("look", 0.3)
    assert second.turn("full", 0.3)  # each kind of round has turns of its own
    time.sleep(0.35)
    assert second.turn("look", 0.3)
    assert not first.turn("look", 0.3)


def test_lease_lock_expires_by_itself(r: Redis[bytes]) -> None:
    lock = LeaseLock(r, "feeder", "w1", lease_seconds=5)
    with lock.hold() as mine:
        assert mine
        assert 0 < r.pttl("llmq:leader:feeder") <= 5000


def test_lease_lock_is_taken_over_from_a_holder_known_dead(r: Redis[bytes]) -> None:
    """A worker killed in the middle of a round keeps the lock until its lease ends (20 s
    by default) unless the others may take it over once its presence lapsed."""
    key = "llmq:leader:takeover"
    gone: set[str] = set()
    lock = LeaseLock(r, "takeover", "w2", lease_seconds=20, holder_gone=lambda holder: holder in gone)
    r.set(key, "w1", px=20_000)  # w1 took it, then was killed
    gone.add("w1")
    with lock.hold() as mine:
        assert not mine  # held for less than a round may take: not looked at
    r.pexpire(key, 20_000 - 1_500)  # held 1.5 s
    gone.clear()
    with lock.hold() as mine:
        assert not mine  # a live holder keeps it
    gone.add("w1")
    with lock.hold() as mine:
        assert mine and r.get(key) == b"w2"
        assert 19_000 < r.pttl(key) <= 20_000
    assert r.get(key) is None  # released as any hold is


# --- idempotency locks --------------------------------------------------------------------


def test_idempotency_lock_refuses_a_concurrent_duplicate(r: Redis[bytes]) -> None:
    locks = IdempotencyLocks(r, lock_seconds=30)
    key = IdempotencyKey.from_header("k1", "/v2/jobs", {"a": 1})
    with locks.hold("tenant-a", key):
        with pytest.raises(Conflict), locks.hold("tenant-a", key):
            pass
        with locks.hold("tenant-b", key):  # keys are per tenant
            pass
    with locks.hold("tenant-a", key):  # released when the first request ended
        pass


# --- job events -----------------------------------------------------------------------------


def test_end_events_are_appended_once_and_notified(r: Redis[bytes]) -> None:
    events = JobEvents(r)
    pubsub = r.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(job_channel("job_1"))
    pubsub.get_message(timeout=1)
    end = end_event(1, "cancelled", None)
    events.append_end("job_1", end)
    events.append_end("job_1", end)  # the same id again is refused by the stream, silently
    entries = r.xrange(job_stream("job_1"))
    assert [json.loads(fields[b"e"])["status"] for _, fields in entries] == ["cancelled"]
    assert r.ttl(job_stream("job_1")) > 0
    message = None
    deadline = time.monotonic() + 2
    while message is None and time.monotonic() < deadline:
        message = pubsub.get_message(timeout=0.1)
    assert message is not None and message["data"].endswith(b" end")
    pubsub.close()


def test_wait_for_end_wakes_on_the_end_notification(r: Redis[bytes]) -> None:
    events = JobEvents(r)
    done = threading.Event()
    result: list[bool] = []

    def wait() -> None:
        result.append(events.wait_for_end("job_2", lambda: False, timeout=5))
        done.set()

    waiter = threading.Thread(target=wait)
    waiter.start()
    # The waiter subscribes before it looks; publish until it has.
    deadline = time.monotonic() + 5
    while not done.is_set() and time.monotonic() < deadline:
        events.append_end("job_2", end_event(1, "succeeded", None))
        done.wait(0.05)
    waiter.join(5)
    assert result == [True]


# --- queue markers and deliveries ----------------------------------------------------------------


def test_markers_say_which_jobs_have_a_live_message(r: Redis[bytes]) -> None:
    # A real producer's configuration; it never connects (the messages go through `r`).
    celery = create_producer(Settings(redis_url="redis://127.0.0.1:9/0"))
    liveness = Liveness(r, marker_ttl_seconds=60)
    queue = JobQueue(celery, liveness)
    queue.enqueue("job_a", "m", 0)
    queue.enqueue_chunk(["job_b", "job_c"], "m", 0)
    # Each message on its priority list (single jobs 3, batch lines 6), with its markers.
    lists = ("llmq.m:3", "llmq.m:6")
    sent = [json.loads(raw)["headers"]["task"] for key in lists for raw in r.lrange(key, 0, -1)]
    assert sent == ["llmq.run_job", "llmq.run_jobs"]
    assert liveness.missing_markers(["job_a", "job_b", "job_c", "job_d"]) == ["job_d"]
    assert 0 < r.ttl(SENT_MARKER.format(job_id="job_a")) <= 60
    assert all(0 < r.ttl(SENT_MARKER.format(job_id=j)) <= 60 for j in ("job_b", "job_c"))
    liveness.spent("job_a", "job_b")
    assert liveness.missing_markers(["job_a", "job_b", "job_c"]) == ["job_a", "job_b"]


def test_stale_deliveries_name_their_jobs_and_can_be_dropped(r: Redis[bytes]) -> None:
    liveness = Liveness(r, marker_ttl_seconds=60)
    now = time.time()
    r.hset(UNACKED, "old", _unacked_message("llmq.run_jobs", [["job_x", "job_y"]]))
    r.hset(UNACKED, "new", _unacked_message("llmq.run_job", ["job_z"]))
    r.hset(UNACKED, "junk", b"not json")
    r.zadd(UNACKED_INDEX, {"old": now - 120, "new": now, "junk": now - 120})
    assert liveness.stale_deliveries(60) == {"old": ["job_x", "job_y"]}
    assert liveness.delivered_job_ids() == {"job_x", "job_y", "job_z"}
    liveness.drop_deliveries(["old"])
    assert liveness.stale_deliveries(60) == {}
    assert r.hexists(UNACKED, "new")


def test_queue_depth_counts_every_priority_list(r: Redis[bytes]) -> None:
    liveness = Liveness(r, marker_ttl_seconds=60)
    r.rpush("llmq.m", b"1", b"2")
    r.rpush("llmq.m:6", b"3")
    r.rpush("llmq.other", b"4")
    assert liveness.depth("m") == 3


class CountingLifecycle:
    """Stands in for BatchLifecycle: the scheduler's rounds are what is under test."""

    def __init__(self) -> None:
        self.rounds: list[float] = []
        self.active = True  # any_active's answer
        self.probes = 0
        self.owed = True  # whether a round's feed finds lines owed
        self.finalized = 0

    def any_active(self) -> bool:
        self.probes += 1
        return self.active

    def feed(self) -> Any:
        self.rounds.append(time.monotonic())
        return type("Fed", (), {"lines": 0, "messages": 0, "owed": self.owed})()

    def resume_validating(self) -> None: ...
    def expire_due(self) -> int:
        return 0

    def end_left_lines(self) -> int:
        return 0

    def finalize_done(self) -> int:
        self.finalized += 1
        return 0


def test_a_chunk_ending_wakes_the_feeder_before_its_tick(r: Redis[bytes]) -> None:
    from app.queue import WAKE_KEY, wake_feeder
    from worker.batches import BatchScheduler

    lifecycle = CountingLifecycle()
    lock = LeaseLock(r, "batches-test", "w1", lease_seconds=5)
    scheduler = BatchScheduler(lock, lifecycle, tick_seconds=5.0, redis=r)  # type: ignore[arg-type]
    scheduler.start()
    try:
        time.sleep(0.3)
        assert lifecycle.rounds == []  # the tick is 5 s away
        woken = time.monotonic()
        wake_feeder(r)
        deadline = time.monotonic() + 3
        while not lifecycle.rounds and time.monotonic() < deadline:
            time.sleep(0.01)
        assert lifecycle.rounds and lifecycle.rounds[0] - woken < 1.0
        time.sleep(0.2)
        assert len(lifecycle.rounds) == 1 and r.llen(WAKE_KEY) == 0
    finally:
        scheduler.stop()
        wake_feeder(r)  # out of its 5 s BLPOP, so the thread ends before the client closes
        assert scheduler.join(3)


def test_batches_are_finalized_once_a_second_while_lines_are_owed_and_in_every_round_after(
    r: Redis[bytes],
) -> None:
    """While lines wait for messages, no batch can be done: finished batches are looked for
    once a second. Once none waits, the lines out may be a batch's last, and each round
    (woken as a chunk ends) looks, so the batch completes as its last line does."""
    from worker.batches import BatchScheduler

    lifecycle = CountingLifecycle()
    lock = LeaseLock(r, "batches-finalize-test", "w1", lease_seconds=5)
    scheduler = BatchScheduler(lock, lifecycle, tick_seconds=0.05, redis=r)  # type: ignore[arg-type]
    scheduler.start()
    try:
        deadline = time.monotonic() + 3
        while len(lifecycle.rounds) < 8 and time.monotonic() < deadline:
            time.sleep(0.01)
        # The first round's, then one a second: not one a round.
        span = lifecycle.rounds[-1] - lifecycle.rounds[0]
        assert len(lifecycle.rounds) >= 8 and 1 <= lifecycle.finalized <= 1 + span
        assert lifecycle.finalized < len(lifecycle.rounds) / 2
        lifecycle.owed = False
        rounds, finalized = len(lifecycle.rounds), lifecycle.finalized
        deadline = time.monotonic() + 3
        while len(lifecycle.rounds) < rounds + 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert lifecycle.finalized - finalized >= 3
    finally:
        scheduler.stop()
        assert scheduler.join(3)


def test_with_no_batch_active_a_round_is_one_probe_and_the_next_waits_the_idle_tick(r: Redis[bytes]) -> None:
    """Idle, a round asks whether any batch is active and stops there (no look for owed
    lines, no batch to end), and the next waits the idle tick, not the tick, unless a
    wake-up (a batch created) comes first: that round looks at once, whoever has the idle
    rounds' turn; then rounds feed at the tick again."""
    from app.queue import wake_feeder
    from worker.batches import BatchScheduler

    lifecycle = CountingLifecycle()
    lifecycle.active = False
    lock = LeaseLock(r, "batches-idle-test", "w1", lease_seconds=5)
    scheduler = BatchScheduler(lock, lifecycle, tick_seconds=0.05, idle_tick_seconds=5.0, redis=r)  # type: ignore[arg-type]
    scheduler.start()
    try:
        deadline = time.monotonic() + 3
        while lifecycle.probes < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.5)  # ten ticks, well short of the idle tick
        assert lifecycle.probes == 1 and lifecycle.rounds == []
        # Another worker has the idle rounds' turn: a round a wake-up began looks anyway.
        r.set("llmq:leader:batches-idle-test:turn:idle", "w2", px=30_000)
        lifecycle.active = True
        woken = time.monotonic()
        wake_feeder(r)
        deadline = time.monotonic() + 3
        while len(lifecycle.rounds) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(lifecycle.rounds) >= 3 and lifecycle.rounds[0] - woken < 1.0  # then at the tick
        # While active, the question is asked once a second, not in every round.
        assert lifecycle.probes <= 2 + (time.monotonic() - woken) + 1
    finally:
        scheduler.stop()
        wake_feeder(r)
        assert scheduler.join(3)


def test_idle_the_fleet_asks_whether_a_batch_is_active_once_an_idle_tick(r: Redis[bytes]) -> None:
    """Each idle worker's feeder asked once an idle tick; the round now goes to the first
    worker to ask in each idle tick, and the others skip it unless a wake-up ended their
    pause (the test above)."""
    from worker.batches import BatchScheduler

    lifecycles = [CountingLifecycle() for _ in range(4)]
    for lifecycle in lifecycles:
        lifecycle.active = False
    schedulers = [
        BatchScheduler(
            LeaseLock(r, "batches-fleet-test", f"w{i}", lease_seconds=5),
            lifecycle,  # type: ignore[arg-type]
            tick_seconds=0.05,
            idle_tick_seconds=0.25,
            redis=r,
        )
        for i, lifecycle in enumerate(lifecycles)
    ]
    for scheduler in schedulers:
        scheduler.start()
        time.sleep(0.06)  # workers' rounds at phases of their own, as in a fleet
    try:
        time.sleep(0.3)  # each worker's first round (not idle) has looked
        before = sum(lifecycle.probes for lifecycle in lifecycles)
        time.sleep(1.0)
        # Four workers each asking every 0.25 s: about 16 in the second; one a tick: 4.
        assert 1 <= sum(lifecycle.probes for lifecycle in lifecycles) - before <= 6
    finally:
        for scheduler in schedulers:
            scheduler.stop()
        for scheduler in schedulers:
            assert scheduler.join(3)


def test_wake_ups_nobody_took_coalesce_into_one(r: Redis[bytes]) -> None:
    from app.queue import WAKE_KEY, wake_feeder

    for _ in range(5):
        wake_feeder(r)
    assert r.llen(WAKE_KEY) == 1
