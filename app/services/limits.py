"""Per-key request rate limit: a token bucket in Redis (one atomic script per request), so
the limit holds across every API process. A key over its rate gets 429 with Retry-After;
other keys are not touched."""

from __future__ import annotations

import math

from redis import Redis

from app.errors import RateLimited

# KEYS: bucket. ARGV: tokens per second, burst. Returns 0 when allowed, else seconds to wait.
_TAKE = """
local rate = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local state = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(state[1]) or burst
local ts = tonumber(state[2]) or now
tokens = math.min(burst, tokens + math.max(0, now - ts) * rate)
local wait = 0
if tokens >= 1 then tokens = tokens - 1 else wait = (1 - tokens) / rate end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'ts', tostring(now))
redis.call('EXPIRE', KEYS[1], math.ceil(burst / rate) + 1)
return tostring(wait)
"""
# The same, and the value of KEYS[2] (a counter; 0 when missing) read in the same round trip.
_TAKE_AND_READ = _TAKE.replace(
    "return tostring(wait)", "return {tostring(wait), redis.call('GET', KEYS[2]) or '0'}"
)


class RateLimiter:
    """`scope` names the buckets (`llmq:<scope>:<subject>`) and `subject_name` says in the
    429 what was limited: a key by default, a client address for failed authentications."""

    def __init__(
        self,
        redis: Redis[bytes],
        *,
        per_minute: int,
        burst: int,
        scope: str = "rate",
        subject_name: str = "requests per minute reached for this key",
    ) -> None:
        self._redis = redis
        self._rate = per_minute / 60.0
        self._burst = max(1, burst)
        self._scope = scope
        self._subject_name = subject_name
        self._take = redis.register_script(_TAKE)
        self._take_and_read = redis.register_script(_TAKE_AND_READ)

    @property
    def enabled(self) -> bool:
        return self._rate > 0

    def check(self, key_id: str) -> None:
        """Takes one token from `key_id`'s bucket. Raises RateLimited (429, with the seconds
        to wait) when it is over its rate."""
        if not self.enabled:
            return
        wait = float(self._take(keys=[f"llmq:{self._scope}:{key_id}"], args=[self._rate, self._burst]))
        self._refuse_past(wait)

    def check_and_read(self, key_id: str, counter: str) -> int:
        """`check` of an enabled limiter, and the Redis counter `counter` (0 when missing)
        read in the same round trip (the API's key cache reads its generation so:
        app/services/keys.py)."""
        wait, value = self._take_and_read(
            keys=[f"llmq:{self._scope}:{key_id}", counter], args=[self._rate, self._burst]
        )
        self._refuse_past(float(wait))
        return int(value)

    def _refuse_past(self, wait: float) -> None:
        if wait > 0:
            raise RateLimited(
                f"rate limit of {self._rate * 60:g} {self._subject_name}; retry in {math.ceil(wait)} s",
                retry_after=wait,
            )
