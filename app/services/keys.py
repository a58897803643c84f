"""Tenants and API keys. Keys are random, shown once, stored as sha256."""

from __future__ import annotations

import copy
import hashlib
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from redis import Redis
from redis.exceptions import RedisError
from sqlalchemy import select, text, update
from sqlalchemy.dialects.postgresql import insert

from app.db import Database
from app.domain.structured import Lru
from app.errors import NotFound, Unauthorized
from app.ids import new_id
from app.logs import remember_secret
from app.models import ApiKey, Tenant
from app.services.priority import PriorityBand

if TYPE_CHECKING:
    from app.services.limits import RateLimiter

log = logging.getLogger("llmq.keys")

# Every request runs this: a constant text statement costs SQLAlchemy no statement building
# or cache-key walk (a `select()` built per call was about a tenth of a submit's CPU).
_AUTHENTICATE = text(
    "SELECT k.id, k.tenant_id, t.priority_min, t.priority_max FROM api_keys k "
    "JOIN tenants t ON t.id = k.tenant_id WHERE k.key_hash = :key_hash AND k.revoked_at IS NULL"
)

# Bumped (INCR) whenever a key stops authenticating or a tenant's priority band changes:
# every API process's cached lookups read under an older value are read again.
AUTH_GENERATION = "llmq:auth:generation"

KEY_PREFIX = "llmq-"
# The largest fair-share weight an operator may give a tenant (the default is 1).
MAX_SHARE_WEIGHT = 1000.0


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def generate_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


@dataclass(frozen=True)
class Principal:
    """Who is calling: the tenant every object they touch must belong to."""

    tenant_id: str
    key_id: str
    # The `priority` values this tenant may ask for.
    priority: PriorityBand = field(default_factory=PriorityBand)


@dataclass(frozen=True)
class KeyInfo:
    id: str
    tenant: str
    prefix: str
    name: str | None
    created_at: datetime
    revoked_at: datetime | None


def _again(error: Exception | None) -> Exception | None:
    """A copy of `error` for another request to raise (each gets its own traceback); None
    when there is none or it cannot be copied."""
    if error is None:
        return None
    try:
        return copy.copy(error)
    except Exception:  # noqa: BLE001 - an error that cannot be copied is not shared
        return None


@dataclass
class _Flight:
    """One key's lookup in Postgres that other requests with the same key wait for."""

    generation: int  # AUTH_GENERATION as read before it began
    done: threading.Event = field(default_factory=threading.Event)
    principal: Principal | None = None
    # Why it failed, when it failed other than with an unknown key (a full pool, Postgres
    # away): each waiting request fails the same way at once, not after a lookup of its own.
    error: Exception | None = None


@dataclass(frozen=True)
class _Lookup:
    principal: Principal
    generation: int  # AUTH_GENERATION as read before the lookup
    until: float  # monotonic


class KeyCache:
    """One API process's recent successful key lookups, by sha256 of the key. An entry
    answers while Redis's AUTH_GENERATION still has the value read before its lookup, and
    for `seconds` at most (a change made in Postgres by hand, or a bump lost while Redis
    was down, is seen within that). Unknown and revoked keys are never kept."""

    def __init__(self, seconds: float, size: int = 10_000) -> None:
        self.seconds = seconds
        self._entries: Lru[str, _Lookup] = Lru(size)
        self._flights: dict[str, _Flight] = {}  # lookups under way, by digest
        self._flights_lock = threading.Lock()

    def join_or_lead(self, digest: str, generation: int) -> tuple[_Flight, bool]:
        """The lookup of `digest` under way, or a new one begun under `generation`; True: the
        caller leads it (looks the key up, then `land`s). Requests arriving together with a
        key not yet cached then wait for one lookup instead of each making its own (60
        downloads at once made 60 identical queries, each queued for the pool). Other keys
        never wait for it."""
        with self._flights_lock:
            flight = self._flights.get(digest)
            if flight is not None:
                return flight, False
            flight = self._flights[digest] = _Flight(generation)
            return flight, True

    def land(
        self, digest: str, flight: _Flight, principal: Principal | None, error: Exception | None = None
    ) -> None:
        """End the lookup `flight` led: `principal`, or None when it failed (`error`: why,
        when it is to be shared)."""
        with self._flights_lock:
            self._flights.pop(digest, None)
        flight.principal, flight.error = principal, error
        flight.done.set()

    def get(self, digest: str) -> _Lookup | None:
        found = self._entries.get(digest)
        if found is not None and found.until <= time.monotonic():
            self._entries.drop(digest)
            return None
        return found

    def put(self, digest: str, principal: Principal, generation: int) -> None:
        kept = self._entries.get(digest)
        if kept is not None and kept.generation > generation:
            return  # a lookup begun later already answered
        self._entries.put(digest, _Lookup(principal, generation, time.monotonic() + self.seconds))

    def drop(self, digest: str) -> None:
        self._entries.drop(digest)


class KeyService:
    def __init__(
        self, db: Database, *, redis: Redis[bytes] | None = None, cache: KeyCache | None = None
    ) -> None:
        """`redis`: where AUTH_GENERATION lives (revoking a key or changing a band bumps it);
        `cache`: an API process's lookups (needs `redis`)."""
        self._db = db
        self._redis = redis
        self._cache = cache if redis is not None else None

    def ensure_tenant(self, name: str) -> str:
        """Create the tenant if missing; returns its id (the name is the id)."""
        with self._db.session() as s:
            s.execute(insert(Tenant).values(id=name, name=name).on_conflict_do_nothing())
        return name

    def create_key(self, tenant: str, *, name: str | None = None, key: str | None = None) -> str:
        """Register `key` (or a new random one) for `tenant`; returns the key itself.

        Registering a key that already exists for the same tenant is a no-op, so a
        bootstrap key can be passed on every start.
        """
        tenant_id = self.ensure_tenant(tenant)
        key = key or generate_key()
        remember_secret(key)
        with self._db.session() as s:
            existing = s.scalar(select(ApiKey).where(ApiKey.key_hash == hash_key(key)))
            if existing is not None:
                if existing.tenant_id != tenant_id:
                    raise ValueError("that key is already registered for another tenant")
                if existing.revoked_at is not None:
                    raise ValueError("that key was revoked; choose another")
                return key
            s.add(
                ApiKey(
                    id=new_id("key"),
                    tenant_id=tenant_id,
                    key_hash=hash_key(key),
                    prefix=key[:12],
                    name=name,
                )
            )
        return key

    def authenticate(self, key: str | None) -> Principal:
        """Raises:
        Unauthorized: no key, unknown key or revoked key (the same message for each).
        """
        if not key:
            raise Unauthorized(
                "missing API key: send 'Authorization: Bearer <key>', "
                "or HTTP Basic with the key as the user name"
            )
        with self._db.reading() as s:
            row = s.execute(_AUTHENTICATE, {"key_hash": hash_key(key)}).first()
        if row is None:
            raise Unauthorized("invalid API key")
        remember_secret(key)
        return Principal(
            tenant_id=row.tenant_id,
            key_id=row.id,
            priority=PriorityBand(row.priority_min, row.priority_max),
        )

    def admit(self, key: str | None, limiter: RateLimiter) -> Principal:
        """`authenticate`, then one request taken from the key's rate (`limiter`). With a
        cache, a key seen lately costs one Redis round trip for both: the rate script also
        reads AUTH_GENERATION, and the cached answer stands while that is unchanged.

        Raises:
            Unauthorized: no key, unknown key or revoked key.
            RateLimited: the key is over its rate.
        """
        if self._cache is None or not key:
            found = self.authenticate(key)
            limiter.check(found.key_id)
            return found
        digest = hash_key(key)
        hit = self._cache.get(digest)
        if hit is None:
            found = self._look_up_once(key, digest, self._generation())
            limiter.check(found.key_id)
            return found
        generation: int | None
        if limiter.enabled:  # needs Redis, as without the cache
            generation = limiter.check_and_read(hit.principal.key_id, AUTH_GENERATION)
        else:
            generation = self._generation()
        if generation == hit.generation:
            return hit.principal
        return self._look_up_once(key, digest, generation)  # its request is counted already

    def _look_up_once(self, key: str, digest: str, generation: int | None) -> Principal:
        """`_look_up`, shared by the requests that ask for the same key while it runs.
        `generation`: AUTH_GENERATION as this request read it. A request shares only a
        lookup begun under the same generation, so no key was revoked since it began (a
        revocation commits, then bumps the generation). An unknown key is not shared (it may
        have been created since): each waiting request then looks it up itself, as it would
        have without waiting. Another failure (a full pool) is each waiting request's too."""
        assert self._cache is not None
        if generation is None:  # Redis is away: no way to tell what changed
            return self._look_up(key, digest, None)
        flight, leader = self._cache.join_or_lead(digest, generation)
        if not leader:
            if flight.generation == generation:
                flight.done.wait()
                if flight.principal is not None:
                    return flight.principal
                again = _again(flight.error)
                if again is not None:
                    raise again
            return self._look_up(key, digest, generation)
        found, error = None, None
        try:
            found = self._look_up(key, digest, generation)
            return found
        except Unauthorized:
            raise
        except Exception as exc:
            error = exc
            raise
        finally:
            self._cache.land(digest, flight, found, error)

    def _look_up(self, key: str, digest: str, generation: int | None) -> Principal:
        """Postgres's answer, kept only when the generation could be read before it
        (`generation`, None when it could not)."""
        assert self._cache is not None
        try:
            found = self.authenticate(key)
        except Unauthorized:
            self._cache.drop(digest)
            raise
        if generation is None:
            self._cache.drop(digest)
        else:
            self._cache.put(digest, found, generation)
        return found

    def close(self) -> None:
        if self._redis is not None:
            self._redis.close()

    def _generation(self) -> int | None:
        """AUTH_GENERATION, read before Postgres; None when Redis does not answer (the API
        gives this service a client that tries once: Postgres answers meanwhile, as it did
        without the cache, and nothing is kept)."""
        assert self._redis is not None
        try:
            return int(self._redis.get(AUTH_GENERATION) or 0)
        except RedisError:
            return None

    def _changed(self, what: str) -> None:
        """Tell every API process's key cache that a lookup may answer differently now."""
        if self._redis is None:
            return
        try:
            self._redis.incr(AUTH_GENERATION)
        except RedisError as exc:
            log.warning(
                "could not tell the API's key caches; they see the change within their cache time",
                extra={"change": what, "error": str(exc)},
            )

    def set_priority_band(self, tenant: str, low: int | None = None, high: int | None = None) -> PriorityBand:
        """Set the band of `priority` values a tenant may ask for (either end, or both).

        Raises:
            NotFound: no such tenant.
            ValueError: the band is empty or leaves the documented range.
        """
        with self._db.session() as s:
            row = s.scalar(select(Tenant).where(Tenant.id == tenant).with_for_update())
            if row is None:
                raise NotFound(f"no tenant {tenant!r}", param="tenant")
            band = PriorityBand(
                row.priority_min if low is None else low, row.priority_max if high is None else high
            )
            row.priority_min, row.priority_max = band.low, band.high
        self._changed("priority band")
        return band

    def priority_band(self, tenant: str) -> PriorityBand:
        """Raises NotFound: no such tenant."""
        with self._db.session() as s:
            row = s.execute(
                select(Tenant.priority_min, Tenant.priority_max).where(Tenant.id == tenant)
            ).first()
        if row is None:
            raise NotFound(f"no tenant {tenant!r}", param="tenant")
        return PriorityBand(row.priority_min, row.priority_max)

    def set_share_weight(self, tenant: str, weight: float) -> float:
        """Set a tenant's weight in the fair share of batch dispatch (default 1: a tenant
        with weight 2 gets twice the lines of one with weight 1 while both have lines
        waiting).

        Raises:
            NotFound: no such tenant.
            ValueError: the weight is not in (0, MAX_SHARE_WEIGHT].
        """
        if not 0 < weight <= MAX_SHARE_WEIGHT:  # NaN fails this too
            raise ValueError(f"a weight must be above 0 and at most {MAX_SHARE_WEIGHT:g}")
        with self._db.session() as s:
            row = s.scalar(select(Tenant).where(Tenant.id == tenant).with_for_update())
            if row is None:
                raise NotFound(f"no tenant {tenant!r}", param="tenant")
            row.share_weight = weight
        return weight

    def share_weight(self, tenant: str) -> float:
        """Raises NotFound: no such tenant."""
        with self._db.session() as s:
            weight = s.scalar(select(Tenant.share_weight).where(Tenant.id == tenant))
        if weight is None:
            raise NotFound(f"no tenant {tenant!r}", param="tenant")
        return float(weight)

    def set_batch_token_budget(self, tenant: str, tokens: int | None) -> None:
        """The tenant's own batch token budget per model (app/services/budgets.py): 0 is no
        limit, None follows LLMQ_BATCH_TOKEN_BUDGET.

        Raises:
            NotFound: no such tenant.
            ValueError: a negative budget.
        """
        if tokens is not None and tokens < 0:
            raise ValueError(f"a batch token budget is 0 (no limit) or more; got {tokens}")
        with self._db.session() as s:
            row = s.scalar(select(Tenant).where(Tenant.id == tenant).with_for_update())
            if row is None:
                raise NotFound(f"no tenant {tenant!r}", param="tenant")
            row.batch_token_budget = tokens

    def batch_token_budget(self, tenant: str) -> int | None:
        """The tenant's own budget (None: it follows the setting). Raises NotFound."""
        with self._db.session() as s:
            row = s.execute(select(Tenant.batch_token_budget).where(Tenant.id == tenant)).first()
        if row is None:
            raise NotFound(f"no tenant {tenant!r}", param="tenant")
        return None if row.batch_token_budget is None else int(row.batch_token_budget)

    def active(self, key_ids: list[str]) -> set[str]:
        """Which of `key_ids` still authenticate (exist and are not revoked)."""
        if not key_ids:
            return set()
        with self._db.session() as s:
            rows = s.scalars(select(ApiKey.id).where(ApiKey.id.in_(key_ids), ApiKey.revoked_at.is_(None)))
            return set(rows)

    def list_keys(self, tenant: str | None = None) -> list[KeyInfo]:
        with self._db.session() as s:
            q = select(ApiKey).order_by(ApiKey.created_at)
            if tenant:
                q = q.where(ApiKey.tenant_id == tenant)
            return [
                KeyInfo(k.id, k.tenant_id, k.prefix, k.name, k.created_at, k.revoked_at) for k in s.scalars(q)
            ]

    def revoke(self, key_id: str) -> None:
        """Raises:
        NotFound: no key with that id.
        """
        with self._db.session() as s:
            done = s.execute(
                update(ApiKey)
                .where(ApiKey.id == key_id, ApiKey.revoked_at.is_(None))
                .values(revoked_at=datetime.now(UTC))
                .returning(ApiKey.id)
            ).first()
        if done is None:
            raise NotFound(f"no active key {key_id!r}", param="key_id")
        self._changed("key revoked")
