"""A cluster-wide mutex with a lease, in Redis: one worker at a time runs the sweeper or the
batch scheduler. A holder that is paused or partitioned loses it when the lease ends, so it
can never stall the cluster (a Postgres advisory lock would stay with its connection). The
work done under it is safe to repeat; the mutex only avoids doing it twice."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import contextmanager

from redis import Redis
from redis.exceptions import RedisError

# Delete the key only if this holder still owns it.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class LeaseLock:
    def __init__(self, redis: Redis[bytes], name: str, owner: str, *, lease_seconds: float) -> None:
        self._redis = redis
        self._key = f"llmq:leader:{name}"
        self._owner = owner
        self._lease_ms = int(lease_seconds * 1000)
        self._release = redis.register_script(_RELEASE)

    @contextmanager
    def hold(self) -> Iterator[bool]:
        """Yields whether this caller holds the lock (it does not wait)."""
        try:
            got = bool(self._redis.set(self._key, self._owner, nx=True, px=self._lease_ms))
        except RedisError:
            got = False
        try:
            yield got
        finally:
            if got:
                with contextlib.suppress(RedisError):  # the lease ends by itself
                    self._release(keys=[self._key], args=[self._owner])
