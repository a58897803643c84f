"""Sends the outbox (app/services/webhook_outbox.py) at least once.

Every worker process runs one deliverer on its own threads (worker/runtime.py), with its
own small connection pool, so a slow or dead receiver occupies at most `concurrency`
delivery threads and never a job thread or a job's database connection.

One attempt:
1. claim (a short transaction): due `pending` rows, `FOR UPDATE SKIP LOCKED` so many
   deliverers share the queue; `attempts` + 1 and `next_attempt_at` pushed past the
   attempt's longest duration, so a deliverer that dies mid-attempt leaves the row to be
   claimed again later (at least once: the receiver dedupes on `webhook-id`);
2. POST with no transaction open: signed body, connect and read time limits, redirects not
   followed, the destination judged again (DNS rebinding) and pinned;
3. record (a short transaction): a 2xx is `delivered`; anything else (another status, a
   timeout, a refused address) plans the next attempt by the RetrySchedule, or, past the
   event's lifetime, `failed`. A late outcome of a claim that was taken over is ignored.

No session state, advisory lock or LISTEN is used: it runs behind PgBouncer's transaction
pooling as it does on Postgres itself.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime

import httpx
from sqlalchemy import text

from app.db import Database
from app.domain.webhooks import RetrySchedule, event_body, signed_headers
from app.services.addresses import Resolver
from app.services.webhook_targets import Refused, pin

log = logging.getLogger("llmq.webhooks")

_CLAIM = text(
    """
    UPDATE webhook_deliveries d SET
      attempts = d.attempts + 1, last_attempt_at = now(),
      next_attempt_at = now() + make_interval(secs => :hold)
    FROM webhook_endpoints e
    WHERE (d.endpoint_id, d.event_id) IN (
        SELECT endpoint_id, event_id FROM webhook_deliveries
        WHERE status = 'pending' AND next_attempt_at <= now()
        ORDER BY next_attempt_at LIMIT :n FOR UPDATE SKIP LOCKED)
      AND e.id = d.endpoint_id
    RETURNING d.endpoint_id, d.event_id, d.type, d.subject_id, d.created_at, d.attempts,
      e.url, e.secret,
      CASE WHEN e.previous_secret_expires_at > now() THEN e.previous_secret END AS previous_secret
    """
)

_DELIVERED = text(
    """
    UPDATE webhook_deliveries SET status = 'delivered', delivered_at = now(),
      last_status_code = :code, last_error = NULL
    WHERE endpoint_id = :endpoint AND event_id = :event AND status = 'pending'
    """
)

# Only the holder of the latest claim plans the next attempt.
_RETRY = text(
    """
    UPDATE webhook_deliveries SET
      next_attempt_at = now() + make_interval(secs => :wait), last_status_code = :code, last_error = :error
    WHERE endpoint_id = :endpoint AND event_id = :event AND status = 'pending' AND attempts = :attempts
    """
)

_FAILED = text(
    """
    UPDATE webhook_deliveries SET status = 'failed', failed_at = now(),
      last_status_code = :code, last_error = :error
    WHERE endpoint_id = :endpoint AND event_id = :event AND status = 'pending' AND attempts = :attempts
    """
)

MAX_ERROR_CHARS = 500


@dataclass(frozen=True)
class Claimed:
    endpoint_id: str
    event_id: str
    type: str
    subject_id: str
    created_at: datetime
    attempts: int
    url: str
    secret: str
    previous_secret: str | None


@dataclass(frozen=True)
class Outcome:
    ok: bool
    status_code: int | None = None
    error: str | None = None
    retry_after: float | None = None


@dataclass(frozen=True)
class DeliveryConfig:
    connect_timeout: float = 5.0
    timeout: float = 10.0
    concurrency: int = 8
    allow_private: bool = False
    schedule: RetrySchedule = field(default_factory=RetrySchedule)

    @property
    def hold_seconds(self) -> float:
        """How long a claim keeps a row from other deliverers: past the longest attempt."""
        return self.connect_timeout + 2 * self.timeout + 5


def _retry_after(response: httpx.Response) -> float | None:
    raw = response.headers.get("retry-after", "")
    try:
        return max(0.0, float(raw)) if raw else None
    except ValueError:
        return None  # an HTTP date: the schedule's own wait applies


class WebhookDeliverer:
    def __init__(self, db: Database, resolve: Resolver, config: DeliveryConfig) -> None:
        self._db = db
        self._resolve = resolve
        self._config = config
        self._pool = ThreadPoolExecutor(config.concurrency, thread_name_prefix="llmq-webhook")
        self._busy = 0
        self._lock = threading.Lock()
        # No keep-alive: each attempt connects to the address it was pinned to; no proxy
        # from the environment (it would connect to the name, unchecked).
        self._http = httpx.Client(
            timeout=httpx.Timeout(config.timeout, connect=config.connect_timeout),
            follow_redirects=False,
            trust_env=False,
            limits=httpx.Limits(max_keepalive_connections=0),
        )

    # --- the loop -----------------------------------------------------------------------

    def tick(self) -> int:
        """Claim as many due deliveries as there are free delivery threads and start them
        (the Periodic thread returns at once). Returns how many were started."""
        with self._lock:
            free = self._config.concurrency - self._busy
        if free <= 0:
            return 0
        claims = self.claim(free)
        for claim in claims:
            with self._lock:
                self._busy += 1
            self._pool.submit(self._run, claim).add_done_callback(self._done)
        return len(claims)

    def _done(self, _future: Future[None]) -> None:
        with self._lock:
            self._busy -= 1

    def _run(self, claim: Claimed) -> None:
        try:
            self.record(claim, self.attempt(claim))
        except Exception as exc:  # noqa: BLE001 - the claim's hold ends and the row is due again
            log.warning(
                "webhook outcome not recorded",
                extra={"event_id": claim.event_id, "error": f"{type(exc).__name__}: {exc}"},
            )

    def drain(self, timeout: float = 30.0) -> int:
        """Deliver everything due now, waiting for each attempt (tests, `llmq` tools).
        Returns how many attempts were made."""
        made = 0
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            claims = self.claim(self._config.concurrency)
            if not claims:
                break
            for claim, outcome in zip(claims, self._pool.map(self.attempt, claims), strict=True):
                self.record(claim, outcome)
            made += len(claims)
        return made

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._http.close()

    # --- the steps ----------------------------------------------------------------------

    def claim(self, n: int) -> list[Claimed]:
        with self._db.session() as s:
            rows = s.execute(_CLAIM, {"n": n, "hold": self._config.hold_seconds}).all()
        return [Claimed(*r) for r in rows]

    def attempt(self, claim: Claimed) -> Outcome:
        """One signed POST. Never raises: every failure is an Outcome."""
        body = event_body(claim.event_id, claim.type, int(claim.created_at.timestamp()), claim.subject_id)
        secrets_ = [claim.secret] + ([claim.previous_secret] if claim.previous_secret else [])
        headers = signed_headers(secrets_, claim.event_id, int(time.time()), body)
        headers["user-agent"] = "llmq-webhooks/1"
        try:
            target = pin(claim.url, self._resolve, allow_private=self._config.allow_private)
            response = self._http.post(
                target.url, content=body, headers={**headers, **target.headers}, extensions=target.extensions
            )
            response.close()
        except Refused as exc:
            return Outcome(False, error=f"destination refused: {exc}")
        except httpx.TimeoutException as exc:
            return Outcome(False, error=f"timed out ({type(exc).__name__})")
        except httpx.HTTPError as exc:
            return Outcome(False, error=f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS])
        if 200 <= response.status_code < 300:
            return Outcome(True, response.status_code)
        why = "a redirect (not followed)" if 300 <= response.status_code < 400 else "not a 2xx"
        return Outcome(
            False, response.status_code, f"HTTP {response.status_code}: {why}", _retry_after(response)
        )

    def record(self, claim: Claimed, outcome: Outcome) -> None:
        key = {"endpoint": claim.endpoint_id, "event": claim.event_id, "code": outcome.status_code}
        if outcome.ok:
            with self._db.session() as s:
                s.execute(_DELIVERED, key)
            log.info("webhook delivered", extra={"event_id": claim.event_id, "attempts": claim.attempts})
            return
        age = (datetime.now(UTC) - claim.created_at).total_seconds()
        wait = self._config.schedule.delay(claim.attempts, age, outcome.retry_after)
        params = {**key, "error": outcome.error, "attempts": claim.attempts}
        with self._db.session() as s:
            if wait is None:
                s.execute(_FAILED, params)
            else:
                # A little jitter (never longer than the schedule says) spreads the retries
                # of many events that failed together.
                s.execute(_RETRY, {**params, "wait": wait * random.uniform(0.9, 1.0)})  # noqa: S311
        log.warning(
            "webhook attempt failed" if wait is not None else "webhook delivery failed for good",
            extra={
                "event_id": claim.event_id,
                "endpoint_id": claim.endpoint_id,
                "attempts": claim.attempts,
                "error": outcome.error,
            },
        )
