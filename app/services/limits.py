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

    @property
    def enabled(self) -> bool:
        return self._rate > 0

    def check(self, key_id: str) -> None:
        """Takes one token from `key_id`'s bucket. Raises RateLimited (429, with the seconds
        to wait) when it is over its rate."""
        if not self.enabled:
            return
        wait = float(self._take(keys=[f"llmq:{self._scope}:{key_id}"], args=[self._rate, self._burst]))
        if wait > 0:
            raise RateLimited(
                f"rate limit of {self._rate * 60:g} {self._subject_name}; retry in {math.ceil(wait)} s",
                retry_after=wait,
            )
