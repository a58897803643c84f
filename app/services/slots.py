"""Per-key cap on long-lived responses (SSE streams and file downloads).

Each open response holds a slot: a member of the Redis sorted set `llmq:slots:<key id>`
whose score is the time it expires. One thread per process pushes the expiry of every
slot it holds forward while the response lives, and a slot is removed when the response
closes. A process that dies stops refreshing, so its slots lapse after `ttl_seconds`
instead of counting against the key forever.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Generic, TypeVar

from redis import Redis
from redis.exceptions import RedisError

from app.errors import RateLimited
from app.periodic import Periodic

log = logging.getLogger("llmq.slots")

T = TypeVar("T")

# KEYS: the key's set. ARGV: slot id, cap, ttl seconds.
# Returns 0 when the slot was taken, else the seconds until the oldest slot lapses.
_TAKE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then
  local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  return tostring(math.max(1, tonumber(oldest[2]) - now))
end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
redis.call('EXPIRE', KEYS[1], math.ceil(tonumber(ARGV[3])) + 1)
return '0'
"""

# KEYS: sets, one per slot. ARGV: ttl, then the slot ids in KEYS' order.
_REFRESH = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local ttl = tonumber(ARGV[1])
for i, key in ipairs(KEYS) do
  redis.call('ZADD', key, 'XX', now + ttl, ARGV[i + 1])
  redis.call('EXPIRE', key, math.ceil(ttl) + 1)
end
return 0
"""


def _slots_key(key_id: str) -> str:
    return f"llmq:slots:{key_id}"


class StreamSlots:
    def __init__(self, redis: Redis[bytes], *, per_key: int, ttl_seconds: float = 60.0) -> None:
        self._redis = redis
        self._cap = per_key
        self._ttl = ttl_seconds
        self._take = redis.register_script(_TAKE)
        self._refresh = redis.register_script(_REFRESH)
        self._held: dict[str, str] = {}  # slot id -> key id
        self._lock = threading.Lock()
        # Started with the first slot taken: a process that never streams runs no thread.
        self._refresher = Periodic("llmq-slots", ttl_seconds / 4, self._refresh_held, log=log)

    @property
    def enabled(self) -> bool:
        return self._cap > 0

    def acquire(self, key_id: str) -> str | None:
        """A slot for one long-lived response (None when the cap is off).

        Raises:
            RateLimited: the key already holds its cap of open streams and downloads.
        """
        if not self.enabled:
            return None
        slot = uuid.uuid4().hex
        wait = float(self._take(keys=[_slots_key(key_id)], args=[slot, self._cap, self._ttl]))
        if wait > 0:
            raise RateLimited(
                f"this key already has {self._cap} streams and downloads open; close one or "
                f"retry in {round(wait)} s",
                retry_after=wait,
                code="too_many_streams",
            )
        with self._lock:
            self._held[slot] = key_id
        self._ensure_refresher()
        return slot

    def release(self, slot: str | None) -> None:
        if slot is None:
            return
        with self._lock:
            key_id = self._held.pop(slot, None)
        if key_id is None:
            return
        try:
            self._redis.zrem(_slots_key(key_id), slot)
        except RedisError as exc:  # it lapses on its own
            log.warning("slot release failed", extra={"error": type(exc).__name__})

    def attach(self, slot: str | None, body: Iterator[T]) -> Iterator[T]:
        """`body` wrapped so that `slot` is released when the response is closed or
        exhausted, even if it was never iterated."""
        if slot is None:
            return body
        return _Held(body, lambda: self.release(slot))

    @contextmanager
    def released_on_error(self, slot: str | None) -> Iterator[None]:
        """Give `slot` back if the block raises (a 404, a bad request): no response holds it."""
        try:
            yield
        except BaseException:
            self.release(slot)
            raise

    def held(self) -> int:
        with self._lock:
            return len(self._held)

    def _ensure_refresher(self) -> None:
        with self._lock:
            if not self._refresher.started:
                self._refresher.start()

    def _refresh_held(self) -> None:
        with self._lock:
            held = list(self._held.items())
        if held:
            self._refresh(
                keys=[_slots_key(key_id) for _, key_id in held],
                args=[self._ttl, *(slot for slot, _ in held)],
            )


class _Held(Generic[T]):
    """An iterator that runs `on_close` once, when closed or exhausted."""

    def __init__(self, inner: Iterator[T], on_close: Any) -> None:
        self._inner = inner
        self._on_close = on_close
        self._closed = False

    def __iter__(self) -> _Held[T]:
        return self

    def __next__(self) -> T:
        try:
            return next(self._inner)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            close = getattr(self._inner, "close", None)
            if close is not None:
                close()
        finally:
            self._on_close()
