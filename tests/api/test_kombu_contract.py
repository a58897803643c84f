"""A contract test against real kombu: the sweeper reads kombu's Redis transport layout
(the `unacked` hash and the `unacked_index` sorted set, app/liveness.py) by hand, so a kombu
upgrade that changes what a real consumer writes there must break this test, not
production. Messages are sent by llmq's own producer and taken by a real kombu consumer
that does not acknowledge them, as a worker holding (or dying with) a job does."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from kombu import Consumer, Exchange, Queue
from redis import Redis

from app.liveness import UNACKED, UNACKED_INDEX, Liveness
from app.queue import JobQueue, create_producer, queue_name
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
