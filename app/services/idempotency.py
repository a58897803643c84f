"""`Idempotency-Key`: the same key and body give back the same object; a duplicate sent
while the first is still being handled is a 409; the same key with another body is a 422.
Keys are per tenant and kept for `ttl_seconds`.

The object itself carries the key (a unique column per tenant), so a replay survives
restarts; a short Redis lock spots the concurrent duplicate before either is stored.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

from redis import Redis
from sqlalchemy import select
from sqlalchemy.orm import Session

from app.errors import Conflict, InvalidRequest, Unprocessable
from app.models import Batch, Job

MAX_KEY_LENGTH = 256


@dataclass(frozen=True)
class IdempotencyKey:
    key: str
    fingerprint: str  # what was asked: the endpoint and the body, canonically

    @classmethod
    def from_header(cls, raw: str | None, endpoint: str, payload: Any) -> IdempotencyKey | None:
        """Raises InvalidRequest for a key that is too long or not printable."""
        if raw is None or raw == "":
            return None
        if len(raw) > MAX_KEY_LENGTH or not raw.isprintable():
            raise InvalidRequest(
                f"Idempotency-Key must be printable and at most {MAX_KEY_LENGTH} characters",
                param="Idempotency-Key",
            )
        canonical = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        return cls(raw, hashlib.sha256(f"{endpoint}\n{canonical}".encode()).hexdigest())

    def check_same(self, stored_fingerprint: str | None) -> None:
        """Raises Unprocessable when the key was used for a different request."""
        if stored_fingerprint != self.fingerprint:
            raise Unprocessable(
                "this Idempotency-Key was already used with a different request; use a new key",
                param="Idempotency-Key",
                code="idempotency_key_reused",
            )


class IdempotencyLocks:
    def __init__(self, redis: Redis[bytes], *, lock_seconds: int = 60) -> None:
        self._redis = redis
        self._lock_seconds = lock_seconds

    @contextmanager
    def hold(self, tenant_id: str, key: IdempotencyKey | None) -> Iterator[None]:
        """Raises Conflict when a request with this key is being handled right now."""
        if key is None:
            yield
            return
        name = "llmq:idem:" + hashlib.sha256(f"{tenant_id}\n{key.key}".encode()).hexdigest()
        if not self._redis.set(name, 1, nx=True, ex=self._lock_seconds):
            raise Conflict(
                "a request with this Idempotency-Key is still being handled; retry shortly",
                param="Idempotency-Key",
                code="idempotency_key_in_use",
            )
        try:
            yield
        finally:
            self._redis.delete(name)


Replayable = TypeVar("Replayable", Job, Batch)


def find_replay(
    s: Session, model: type[Replayable], tenant_id: str, idem: IdempotencyKey, ttl_seconds: float
) -> Replayable | None:
    """The row this key made before, if it is still within `ttl_seconds` (an older one
    gives its key up, so the key is free again).

    Raises:
        Unprocessable: the key was used with another body.
    """
    row = s.scalar(select(model).where(model.tenant_id == tenant_id, model.idempotency_key == idem.key))
    if row is None:
        return None
    if (datetime.now(UTC) - row.created_at).total_seconds() > ttl_seconds:
        row.idempotency_key = None
        return None
    idem.check_same(row.request_hash)
    return row
