"""The Redis contract (tests/redis_contract.py) against the real Redis server, on a
database of its own, so a difference from fakeredis shows."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis as redis_lib
from redis import Redis

from tests.helpers import REDIS_DB, Stores
from tests.redis_contract import *  # noqa: F403 - the shared tests are collected here


@pytest.fixture
def r(stores: Stores) -> Iterator[Redis[bytes]]:
    base = stores.redis_url.rsplit("/", 1)[0]
    client: Redis[bytes] = redis_lib.Redis.from_url(f"{base}/{(REDIS_DB + 1) % 16}")
    client.flushdb()
    yield client
    client.flushdb()
    client.close()
