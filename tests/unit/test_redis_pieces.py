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
