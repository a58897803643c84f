"""A cluster-wide mutex with a lease, in Redis: one worker at a time runs the sweeper or the
batch scheduler. A holder that is paused or partitioned loses it when the lease ends, so it
can never stall the cluster (a Postgres advisory lock would stay with its connection). A
holder known to be dead (killed in the middle of a round: its presence lapsed) loses it
sooner, to the first worker that asks after the holder has had it for `TAKEOVER_AFTER_MS`:
the lease is long, and the batch feeder stalled for it would leave the dead worker's lines
undispatched that long. The work done under it is safe to repeat; the mutex only avoids
doing it twice.

A round the fleet needs once a period, not once a worker a period, asks for a `turn`: the
first worker to ask in each period has it, and the others skip that round."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from redis import Redis
from redis.exceptions import RedisError

# Delete the key only if this holder still owns it.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
# Take the lock: {1} if it was free; else {0, holder, milliseconds left}: one round trip.
_ACQUIRE = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return {1} end
return {0, redis.call('GET', KEYS[1]), redis.call('PTTL', KEYS[1])}
"""
# Take the lock over from ARGV[1] (dead) only if it still holds it.
_TAKE_OVER = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3]) return 1 end
return 0
"""
# Rounds take milliseconds: a holder that has had the lock this long may be dead.
TAKEOVER_AFTER_MS = 1000


class LeaseLock:
    def __init__(
        self,
        redis: Redis[bytes],
        name: str,
        owner: str,
        *,
        lease_seconds: float,
        holder_gone: Callable[[str], bool] | None = None,
    ) -> None:
        """`holder_gone(owner)`: whether that holder is known to be dead (None: a holder
        keeps the lock until its lease ends)."""
        self._redis = redis
        self._key = f"llmq:leader:{name}"
        self._owner = owner
        self._lease_ms = int(lease_seconds * 1000)
        self._holder_gone = holder_gone
        self._acquire = redis.register_script(_ACQUIRE)
        self._take_over = redis.register_script(_TAKE_OVER)
        self._release = redis.register_script(_RELEASE)

    @contextmanager
    def hold(self) -> Iterator[bool]:
        """Yields whether this caller holds the lock (it does not wait)."""
        try:
            got = self._get()
        except RedisError:
            got = False
        try:
            yield got
        finally:
            if got:
                with contextlib.suppress(RedisError):  # the lease ends by itself
                    self._release(keys=[self._key], args=[self._owner])

    def turn(self, what: str, seconds: float) -> bool:
        """Whether this caller has `what`'s turn: the first worker of the fleet to ask in
        each `seconds` does (a key set if absent, expiring after them). Without Redis, no
        turn: the rounds it gates need Redis and the lock anyway."""
        key = f"{self._key}:turn:{what}"
        try:
            return bool(self._redis.set(key, self._owner, nx=True, px=max(1, int(seconds * 1000))))
        except RedisError:
            return False

    def _get(self) -> bool:
        taken = self._acquire(keys=[self._key], args=[self._owner, self._lease_ms])
        if taken[0] == 1:
            return True
        if len(taken) < 3:  # the lease ended in between: the next round takes it
            return False
        holder, left_ms = taken[1], int(taken[2])
        if self._holder_gone is None or holder is None or self._lease_ms - left_ms < TAKEOVER_AFTER_MS:
            return False
        name = holder.decode() if isinstance(holder, bytes) else str(holder)
        if name == self._owner or not self._holder_gone(name):
            return False
        return bool(self._take_over(keys=[self._key], args=[name, self._owner, self._lease_ms]))
