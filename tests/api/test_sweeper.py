"""The sweeper against real Postgres and a real broker: a message that a worker took and
never claimed (it died first) is sent again, not left for the visibility timeout; the
running jobs of a worker that is gone are sent again at once, not after their leases."""

from __future__ import annotations

import base64
import json
import secrets
import time
from collections.abc import Callable
from typing import Any

import redis
from sqlalchemy import text

from app.cli.embedded import free_port, redis_start
from app.liveness import UNACKED, UNACKED_INDEX
from app.queue import queue_name
from app.services.health import absent_workers, mark_present
from tests.helpers import queued, response
from worker.leader import LeaseLock
from worker.store import JobStore, Result
from worker.sweeper import Sweeper


def waiting(services) -> list[tuple[bytes, bytes, list]]:  # type: ignore[no-untyped-def]
    """(list key, raw message, job ids) of every message waiting in the api-only queue."""
    r = services.redis
    found = []
    for key in r.scan_iter(f"{queue_name('api-only')}*"):
        if r.type(key) == b"list":
            for raw in r.lrange(key, 0, -1):
                found.append((key, raw, json.loads(base64.b64decode(json.loads(raw)["body"]))[0]))
    return found


def take_message(services, job_id: str) -> str:  # type: ignore[no-untyped-def]
    """What a worker that dies at once does to `job_id`'s message: takes it off the queue
    into the broker's unacknowledged set (kombu's layout) and never acknowledges it."""
    r = services.redis
    for key, raw, args in waiting(services):
        if args == [job_id]:
            message = json.loads(raw)
            tag = message["properties"]["delivery_tag"]
            r.lrem(key, 1, raw)
            r.hset(UNACKED, tag, json.dumps([message, "", queue_name("api-only")]))
            r.zadd(UNACKED_INDEX, {tag: time.time()})
            return str(tag)
    raise AssertionError(f"no message for {job_id}")


def sweeper(  # type: ignore[no-untyped-def]
    services,
    interval: float = 1,
    *,
    store: JobStore | None = None,
    lock: LeaseLock | None = None,
    **presence: Any,
) -> Sweeper:
    """A sweeper of its own (a lock no other test's shares), or one worker's of a fleet
    that shares `lock`'s name."""
    lock = lock or LeaseLock(services.redis, f"sweeper-test-{time.time()}", "me", lease_seconds=5)
    return Sweeper(
        services.db,
        store or JobStore(services.db),
        services.queue,
        services.liveness,
        services.events,
        max_attempts=3,
        grace_seconds=30,
        interval_seconds=interval,
        lock=lock,
        **presence,
    )


def age(services, job_id: str, tag: str, seconds: float) -> None:  # type: ignore[no-untyped-def]
    services.redis.zadd(UNACKED_INDEX, {tag: time.time() - seconds})
    with services.db.session() as s:
        s.execute(
            text("UPDATE jobs SET enqueued_at = now() - make_interval(secs => :s) WHERE id = :i"),
            {"s": seconds, "i": job_id},
        )


def test_a_message_taken_and_never_claimed_is_sent_again(services) -> None:
    (job_id,) = queued(services, 1)
    tag = take_message(services, job_id)
    # An hour old, older than anything earlier tests of this session left queued: a sweep
    # resends the oldest 1,000 stale jobs, and this one must be among them whatever else waits.
    age(services, job_id, tag, 3600)

    report = sweeper(services).sweep_once()

    assert report.unclaimed == 1 and report.resent >= 1
    assert services.redis.hget(UNACKED, tag) is None  # never handed out again
    assert take_message(services, job_id) != tag  # a new message names the job


def test_a_running_jobs_message_is_left_alone(services) -> None:
    (job_id,) = queued(services, 1)
    tag = take_message(services, job_id)
    JobStore(services.db).claim_many([job_id], "w-alive", 300, 3)
    age(services, job_id, tag, 60)

    report = sweeper(services).sweep_once()

    assert report.unclaimed == 0
    assert services.redis.hget(UNACKED, tag) is not None


def test_a_message_lost_in_a_crash_before_its_delivery_was_recorded_is_sent_again(services) -> None:
    """kombu pops a message, then records the delivery: a worker killed between the two
    loses the message, while the job's marker still says it was sent."""
    (job_id,) = queued(services, 1)
    tag = take_message(services, job_id)
    services.liveness.drop_deliveries([tag])  # as if never recorded
    for key in services.redis.scan_iter(f"{queue_name('api-only')}*"):  # and nothing else waits
        if services.redis.type(key) == b"list":
            services.redis.delete(key)
    age(services, job_id, tag, 60)
    assert services.liveness.missing_markers([job_id]) == []  # the marker still says "sent"

    report = sweeper(services).sweep_once()

    assert report.resent >= 1
    assert take_message(services, job_id) != tag


def test_a_job_waiting_behind_a_backlog_is_not_sent_twice(services) -> None:
    (job_id,) = queued(services, 1)
    age(services, job_id, "none", 60)
    assert services.liveness.depth("api-only") >= 1

    sweeper(services).sweep_once()

    assert [args for _, _, args in waiting(services)].count([job_id]) == 1


def among(services, prefix: str) -> Callable[[list[str]], set[str]]:  # type: ignore[no-untyped-def]
    """The registry's answer for this test's workers (other tests' rows share the database)."""
    return lambda owners: absent_workers(services.redis, [o for o in owners if o.startswith(prefix)], 5.0)


def status(services, job_id: str) -> tuple[str, int, str | None]:  # type: ignore[no-untyped-def]
    with services.db.session() as s:
        row = s.execute(
            text("SELECT status, epoch, lease_owner FROM jobs WHERE id = :i"), {"i": job_id}
        ).one()
    return row.status, row.epoch, row.lease_owner


def test_a_gone_workers_running_jobs_are_sent_again_before_their_leases_end(services) -> None:
    prefix = f"w-{secrets.token_hex(3)}-"
    gone, alive = f"{prefix}gone", f"{prefix}alive"
    store = JobStore(services.db)
    lost, kept = queued(services, 2)
    store.claim_many([lost], gone, 300, 3)
    store.claim_many([kept], alive, 300, 3)
    mark_present(services.redis, alive, 60)  # `gone` never refreshes its presence again

    report = sweeper(services, absent=among(services, prefix)).sweep_once()

    assert report.gone_workers == 1 and report.requeued == 1
    assert status(services, lost) == ("queued", 1, None)
    assert status(services, kept) == ("running", 1, alive)
    assert [lost] in [args for _, _, args in waiting(services)]  # sent again
    # Another worker takes it over; should the old owner be alive after all, it is fenced.
    assert store.claim(lost, f"{prefix}other", 300, 3) is not None
    assert store.finish_many([Result(lost, 1, "succeeded", response=response("stale"))]) == set()
    assert status(services, lost) == ("running", 2, f"{prefix}other")


def test_a_gone_worker_is_noticed_between_full_rounds(services) -> None:
    prefix = f"w-{secrets.token_hex(3)}-"
    (lost,) = queued(services, 1)
    JobStore(services.db).claim_many([lost], f"{prefix}gone", 300, 3)
    # A full round only every minute; the gone owner is looked for every 0.2 s.
    sweeping = sweeper(services, interval=60, absent=among(services, prefix), presence_check_seconds=0.2)
    started = time.monotonic()
    sweeping.start()
    try:
        while status(services, lost)[0] != "queued":
            assert time.monotonic() - started < 5, "the gone worker's job was not released"
            time.sleep(0.05)
    finally:
        sweeping.stop()
    assert [lost] in [args for _, _, args in waiting(services)]


def test_one_worker_of_the_fleet_looks_for_gone_workers_each_round(services) -> None:
    """Every worker asked Postgres each round which workers hold running jobs (a fleet of
    50: 50 such queries a second); the first to ask in each round's period does, the others
    skip it, and a gone worker's job is still released by the fleet."""
    prefix = f"w-{secrets.token_hex(3)}-"
    (lost,) = queued(services, 1)
    JobStore(services.db).claim_many([lost], f"{prefix}gone", 300, 3)
    looks: list[str] = []

    class Counted(JobStore):
        def running_owners(self) -> list[str]:
            looks.append("look")
            return super().running_owners()

    name = f"sweeper-fleet-{time.time()}"
    fleet = [
        sweeper(
            services,
            interval=60,
            store=Counted(services.db),
            lock=LeaseLock(services.redis, name, f"{prefix}w{i}", lease_seconds=5),
            absent=among(services, prefix),
            presence_check_seconds=0.2,
        )
        for i in range(4)
    ]
    for sweeping in fleet:
        sweeping.start()
    started = time.monotonic()
    try:
        while status(services, lost)[0] != "queued":
            assert time.monotonic() - started < 5, "the gone worker's job was not released"
            time.sleep(0.05)
        looks.clear()
        time.sleep(1.0)
    finally:
        for sweeping in fleet:
            sweeping.stop()
    # Four workers each looking every 0.2 s: about 20 looks in the second; one a period: 5.
    assert 1 <= len(looks) <= 7, looks


def test_right_after_a_redis_restart_no_worker_counts_as_gone(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A restarted Redis has lost every presence with its data: none lapsed. Until live
    workers have had the time to write theirs again, nobody's jobs are taken away."""
    server = redis_start(tmp_path / "redis", free_port(56900), persistent=False)
    try:
        fresh = redis.Redis.from_url(server.url)
        assert absent_workers(fresh, ["w-unknown"], 5.0) == set()
        deadline = time.monotonic() + 10
        while absent_workers(fresh, ["w-unknown"], 0.4) != {"w-unknown"}:  # up 0.8 s: counted
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        server.stop()


def test_the_stale_queued_jobs_are_rows_1_and_4_to_8_of_the_liveness_table(services) -> None:  # type: ignore[no-untyped-def]
    """Which jobs the sweeper looks at (app/liveness.py): a single job never sent (1) and
    any queued job sent before the grace (4-8); not a batch line owed to the feeder (2), a
    job just sent (3), a running job (9) nor an ended one (12)."""
    never, owed, recent, old, running, ended = queued(services, 6)
    batch = f"batch_{secrets.token_hex(4)}"
    with services.db.session() as s:
        for job_id, sql in [
            (never, "enqueued_at = NULL"),
            (owed, "enqueued_at = NULL, batch_id = :b, line_no = 0"),
            (old, "enqueued_at = now() - make_interval(secs => 60)"),
            (running, "status = 'running', enqueued_at = now() - make_interval(secs => 60)"),
            (ended, "status = 'succeeded', enqueued_at = now() - make_interval(secs => 60)"),
        ]:
            s.execute(text(f"UPDATE jobs SET {sql} WHERE id = :i"), {"i": job_id, "b": batch})

    listed = {job.job_id: job.never_sent for job in services.liveness.stale_queued(30, limit=100_000)}

    assert listed.get(never) is True and listed.get(old) is False
    assert {owed, recent, running, ended}.isdisjoint(listed)
