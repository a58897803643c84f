"""Webhooks as Standard Webhooks (https://www.standardwebhooks.com) and OpenAI send them:
the event types, the signing secret, the signed body and headers, and the retry schedule.
Pure functions: no I/O, so the same code signs in the deliverer and in the tests.

- Secret: `whsec_` + base64 of 32 random bytes (the spec asks for 24 to 64); the HMAC key
  is the decoded bytes.
- Body: `{"id": "evt_...", "object": "event", "type", "created_at", "data": {"id"}}`,
  compact JSON, the same bytes on every attempt.
- Headers: `webhook-id` (the event id, the receiver's idempotency key, stable across
  retries), `webhook-timestamp` (unix seconds of this attempt), `webhook-signature`:
  `v1,<base64 HMAC-SHA256(key, "{id}.{timestamp}.{body}")>`, space-separated when an old
  secret is still honoured after a rotation.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
from dataclasses import dataclass
from enum import StrEnum

SECRET_PREFIX = "whsec_"  # noqa: S105 - the format's prefix, not a secret
SECRET_BYTES = 32


class EventType(StrEnum):
    BATCH_COMPLETED = "batch.completed"
    BATCH_FAILED = "batch.failed"
    BATCH_EXPIRED = "batch.expired"
    BATCH_CANCELLED = "batch.cancelled"
    JOB_SUCCEEDED = "job.succeeded"
    JOB_FAILED = "job.failed"
    JOB_CANCELLED = "job.cancelled"


# The job statuses that end a single job with an event (`expired` is for batch lines only).
JOB_EVENT_STATUSES = ("succeeded", "failed", "cancelled")


class DeliveryStatus(StrEnum):
    PENDING = "pending"
    DELIVERED = "delivered"
    FAILED = "failed"


def new_secret() -> str:
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(SECRET_BYTES)).decode()


def secret_key(secret: str) -> bytes:
    """The HMAC key a `whsec_` secret stands for."""
    return base64.b64decode(secret.removeprefix(SECRET_PREFIX))


def secret_hint(secret: str) -> str:
    """Enough of a secret for a person to tell two apart, not enough to sign."""
    return f"{SECRET_PREFIX}****{secret[-4:]}"


def event_body(event_id: str, event_type: str, created_at: int, subject_id: str) -> bytes:
    """The body every attempt of one event sends (byte for byte: the signature covers it)."""
    event = {"id": event_id, "object": "event", "type": event_type, "created_at": created_at}
    event["data"] = {"id": subject_id}
    return json.dumps(event, separators=(",", ":")).encode()


def signature(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """`v1,<base64>`: HMAC-SHA256 of `{msg_id}.{timestamp}.{body}` under the secret's key."""
    signed = f"{msg_id}.{timestamp}.".encode() + body
    digest = hmac.new(secret_key(secret), signed, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def signed_headers(secrets_: list[str], msg_id: str, timestamp: int, body: bytes) -> dict[str, str]:
    """The three Standard Webhooks headers, one signature per secret honoured (the current
    one first, then a rotated-out one still within its grace)."""
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": " ".join(signature(s, msg_id, timestamp, body) for s in secrets_),
        "content-type": "application/json",
    }


@dataclass(frozen=True)
class RetrySchedule:
    """When to try an event again after a failed attempt.

    In the event's first `early` seconds (one hour) the wait doubles from `base` and never
    exceeds `cap` (5 s, 10 s, ... 120 s); after that it grows with the event's age (a
    tenth of it) up to `late_cap`. No attempt is planned past `lifetime` (three days): the
    last one is made at the lifetime's end, and when it fails the delivery is failed.
    """

    base: float = 5.0
    cap: float = 120.0
    late_cap: float = 3600.0
    lifetime: float = 3 * 86400.0
    early: float = 3600.0

    def delay(self, attempts: int, age: float, retry_after: float | None = None) -> float | None:
        """Seconds until the next attempt, after `attempts` attempts of an event `age`
        seconds old, or None when its lifetime is spent. A receiver's `Retry-After`
        (seconds) lengthens the wait, never past the cap that applies."""
        if age >= self.lifetime:
            return None
        if age < self.early:
            cap = self.cap
            wait = min(self.base * 2.0 ** min(max(attempts - 1, 0), 40), cap)
        else:
            cap = self.late_cap
            wait = min(max(self.cap, age / 10), cap)
        if retry_after is not None and retry_after > wait:
            wait = min(retry_after, cap)
        return min(wait, self.lifetime - age)
