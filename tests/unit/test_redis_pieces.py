"""The Redis contract (tests/redis_contract.py) against fakeredis: no server needed."""

from __future__ import annotations

from collections.abc import Iterator

import fakeredis
import pytest
from redis import Redis

from tests.redis_contract import *  # noqa: F403 - the shared tests are collected here


@pytest.fixture
def r() -> Iterator[Redis[bytes]]:
    client: Redis[bytes] = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    yield client
    client.close()


def test_a_wake_up_redis_cannot_take_is_dropped_not_raised() -> None:
    """A worker ending a chunk and the API creating a batch both wake the feeder; with
    Redis away neither fails for it (the feeder's tick still comes)."""
    from app.queue import wake_feeder

    away = Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.5)  # nothing listens
    wake_feeder(away)
