"""A contract test against real kombu and Celery: the sweeper reads kombu's Redis transport
layout (the `unacked` hash and the `unacked_index` sorted set, app/liveness.py) by hand, and
llmq's producer writes messages in kombu's envelope itself (app/queue.py's `TaskMessages`),
so a kombu or Celery upgrade that changes either must break this test, not production.
Messages are sent by llmq's own producer and taken by a real kombu consumer that does not
acknowledge them, as a worker holding (or dying with) a job does."""

from __future__ import annotations

import base64
import json
import secrets
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from kombu import Consumer, Exchange, Queue
from redis import Redis
from redis.exceptions import ResponseError

from app.liveness import SENT_MARKER, UNACKED, UNACKED_INDEX, Liveness
from app.queue import (
    PRIORITY_STEPS,
    RUN_JOB_TASK,
    RUN_JOBS_TASK,
    JobQueue,
    TaskMessages,
    create_producer,
    queue_name,
)
from app.request_ids import MESSAGE_HEADER
from tests.helpers import Stores, make_settings


@pytest.fixture
def broker(stores: Stores) -> Iterator[tuple[JobQueue, Liveness, Any, Redis[bytes]]]:
    settings = make_settings(stores)
    celery = create_producer(settings)
    redis: Redis[bytes] = Redis.from_url(stores.redis_url)
    liveness = Liveness(redis, marker_ttl_seconds=60)
    yield JobQueue(celery, liveness), liveness, celery, redis
    redis.close()


@contextmanager
def take_without_ack(celery: Any, model: str, count: int) -> Iterator[list[Any]]:
    """Consume `count` messages from the model's queue with a real kombu consumer and
    hold them unacknowledged while the caller looks (the connection's close gives them
    back, as kombu does for a worker that stops)."""
    name = queue_name(model)
    taken: list[Any] = []
    with celery.connection_for_read() as conn:
        consumer = Consumer(
            conn.default_channel,
            queues=[Queue(name, Exchange(name), routing_key=name)],
            callbacks=[lambda body, message: taken.append(message)],
            no_ack=False,
        )
        with consumer:
            deadline = time.monotonic() + 10
            while len(taken) < count:
                assert time.monotonic() < deadline, f"took {len(taken)} of {count} messages"
                try:
                    conn.drain_events(timeout=1)
                except TimeoutError:
                    continue
            yield taken


def test_llmq_reads_what_a_real_kombu_consumer_leaves_unacknowledged(
    broker: tuple[JobQueue, Liveness, Any, Redis[bytes]],
) -> None:
    queue, liveness, celery, redis = broker
    model = f"kombu-contract-{secrets.token_hex(3)}"
    single, chunk = f"job_{secrets.token_hex(6)}", [f"job_{secrets.token_hex(6)}" for _ in range(3)]
    queue.enqueue(single, model, 0)
    queue.enqueue_chunk(chunk, model, 0)
    with take_without_ack(celery, model, 2) as taken:
        tags = {str(m.delivery_tag) for m in taken}
        # kombu's own layout: the message under its delivery tag, the tag scored by time.
        assert all(redis.hexists(UNACKED, tag) for tag in tags)
        assert all(redis.zscore(UNACKED_INDEX, tag) is not None for tag in tags)
        assert {single, *chunk} <= liveness.delivered_job_ids()
        ours = {tag: ids for tag, ids in liveness.stale_deliveries(-60).items() if tag in tags}
        assert sorted(ours.values()) == sorted([[single], chunk])
        # Taken just now: not stale yet.
        assert not tags & set(liveness.stale_deliveries(60))
        assert liveness.depth(model) == 0
        liveness.drop_deliveries(sorted(tags))
        assert not any(redis.hexists(UNACKED, tag) for tag in tags)
        assert not {single, *chunk} & liveness.delivered_job_ids()


def test_a_channel_keeps_one_redis_client_until_its_pool_changes(broker: Any) -> None:
    """reuse_broker_clients: kombu asks its channel for a client on every call; llmq's
    producer gets the same one each time (built once, ~130 µs saved a call), and messages
    still go out and come back through it."""
    queue, _liveness, celery, _redis = broker
    with celery.connection_for_write() as conn:
        channel = conn.default_channel
        first = channel._create_client()
        assert channel._create_client() is first
        assert channel._create_client(asynchronous=True) is not first
        channel._pool = None  # what kombu does when the connection is lost
        assert channel._create_client() is not first
    model = f"reuse-{secrets.token_hex(4)}"
    queue.enqueue("job_reuse", model, 0)
    with take_without_ack(celery, model, 1) as taken:
        assert taken[0].payload[0] == ["job_reuse"]


# The fields that differ between two messages by design: fresh ids and delivery tags.
FRESH = {
    ("headers", "id"),
    ("headers", "root_id"),
    ("properties", "correlation_id"),
    ("properties", "delivery_tag"),
}


def comparable(raw: bytes | str) -> dict[str, Any]:
    message = json.loads(raw)
    message["body"] = json.loads(base64.b64decode(message["body"]))
    for part, name in FRESH:
        assert message[part].get(name), (part, name)
        message[part][name] = "<fresh>"
    return message


def pushed(redis: Redis[bytes], queue: str) -> list[tuple[str, bytes]]:
    """(list, message) for every message waiting in `queue`'s priority lists."""
    found = []
    for step in PRIORITY_STEPS:
        name = queue if step == 0 else f"{queue}:{step}"
        found += [(name, raw) for raw in redis.lrange(name, 0, -1)]
    return found


@pytest.mark.parametrize(
    ("task", "args", "priority", "headers"),
    [
        (RUN_JOB_TASK, ["job_a"], 3, {MESSAGE_HEADER: "req_abc"}),
        (RUN_JOB_TASK, ["job_b"], 0, None),
        (RUN_JOBS_TASK, [[f"job_{i:026d}" for i in range(64)]], 9, None),  # argsrepr cut short
        (RUN_JOBS_TASK, [[f"job_{i:026d}" for i in range(8)]], 6, None),
    ],
)
def test_a_message_is_what_celerys_send_task_pushes(
    broker: tuple[JobQueue, Liveness, Any, Redis[bytes]],
    task: str,
    args: list[Any],
    priority: int,
    headers: dict[str, str] | None,
) -> None:
    """Field by field, on the same list: what `send_task` writes and what llmq writes, but
    for the ids and the delivery tag each message gets afresh."""
    _queue, _liveness, celery, redis = broker
    queue = queue_name(f"contract-{secrets.token_hex(3)}")
    celery.send_task(task, args=args, queue=queue, priority=priority, headers=headers)
    ((theirs_list, theirs),) = pushed(redis, queue)
    redis.delete(theirs_list)
    messages = TaskMessages(celery)
    ours = messages.build(task, args, queue=queue, priority=priority, headers=headers)
    assert messages.priority_list(queue, priority) == theirs_list
    assert comparable(ours) == comparable(theirs)


def test_a_pushed_message_and_its_markers_arrive_together(
    broker: tuple[JobQueue, Liveness, Any, Redis[bytes]],
) -> None:
    """One call: the message on its priority list, each job's marker with its TTL; a real
    consumer takes the message as Celery's own."""
    queue, _liveness, celery, redis = broker
    model = f"push-{secrets.token_hex(3)}"
    chunk = [f"job_{secrets.token_hex(6)}" for _ in range(3)]
    queue.enqueue_chunk(chunk, model, 2)  # batch lines: broker priority 8
    queue.enqueue("job_single_push", model, 0, request_id="req_push")  # 3
    assert [name for name, _ in pushed(redis, queue_name(model))] == [
        f"{queue_name(model)}:3",
        f"{queue_name(model)}:8",
    ]
    for job_id in [*chunk, "job_single_push"]:
        assert 0 < redis.ttl(SENT_MARKER.format(job_id=job_id)) <= 60
    with take_without_ack(celery, model, 2) as taken:
        # Priority 3 first, as kombu's priority order takes them.
        assert [m.payload[0] for m in taken] == [["job_single_push"], [chunk]]
        assert taken[0].headers[MESSAGE_HEADER] == "req_push"
        assert taken[0].headers["task"] == RUN_JOB_TASK and taken[1].headers["task"] == RUN_JOBS_TASK


def test_a_refused_push_sets_no_marker(broker: tuple[JobQueue, Liveness, Any, Redis[bytes]]) -> None:
    """The push goes first in the script: when Redis refuses it (here: the list's key holds
    a string), no marker claims a message that does not exist, and the caller hears of it."""
    queue, _liveness, _celery, redis = broker
    model = f"refused-{secrets.token_hex(3)}"
    redis.set(f"{queue_name(model)}:3", "not a list")
    with pytest.raises(ResponseError):
        queue.enqueue("job_refused", model, 0)
    assert not redis.exists(SENT_MARKER.format(job_id="job_refused"))
    redis.delete(f"{queue_name(model)}:3")
