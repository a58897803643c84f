"""Liveness and readiness, and the worker registry readiness reads.

A worker proves it is consuming by refreshing `llmq:worker:<name>` from a task that went
through the broker (see worker/heartbeat.py); a process that is merely alive does not.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from redis import Redis
from redis.exceptions import ResponseError
from sqlalchemy import text

from app.db import Database

WORKER_KEY = "llmq:worker:{name}"
# The names of registered workers, scored by when each last registered: an index, so a
# registry read is one ZRANGE and one MGET, not a SCAN of a keyspace that holds a marker per
# queued job. The entry's own key (and its TTL) decides whether a worker is live.
WORKER_INDEX = "llmq:workers"
# An indexed name whose entry has lapsed is dropped from the index once it is this old (a
# worker that registered again since has a newer score and is kept).
INDEX_PRUNE_SECONDS = 60.0
# A worker process's presence: refreshed by a thread of its own while the process lives,
# consuming or not (the registry entry above comes and goes with consuming). The sweeper
# re-queues the running jobs of a worker whose presence lapsed.
PRESENCE_KEY = "llmq:alive:{name}"


@dataclass
class Readiness:
    ready: bool
    checks: dict[str, Any] = field(default_factory=dict)


def register_worker(redis: Redis[bytes], name: str, info: dict[str, Any], ttl_seconds: int) -> None:
    """Publish `info` (see `WorkerRuntime.info`: the model served, its context length,
    in-flight capacity and tokenizer source) for `ttl_seconds`."""
    pipe = redis.pipeline(transaction=False)
    pipe.set(WORKER_KEY.format(name=name), json.dumps(info), ex=ttl_seconds)
    pipe.zadd(WORKER_INDEX, {name: time.time()})
    pipe.execute()


def unregister_worker(redis: Redis[bytes], name: str) -> None:
    pipe = redis.pipeline(transaction=False)
    pipe.delete(WORKER_KEY.format(name=name))
    pipe.zrem(WORKER_INDEX, name)
    pipe.execute()


def mark_present(redis: Redis[bytes], name: str, ttl_seconds: float) -> None:
    redis.set(PRESENCE_KEY.format(name=name), b"1", px=max(1, int(ttl_seconds * 1000)))


def mark_absent(redis: Redis[bytes], name: str) -> None:
    redis.delete(PRESENCE_KEY.format(name=name))


def absent_workers(redis: Redis[bytes], names: list[str], ttl_seconds: float) -> set[str]:
    """Those of `names` whose presence lapsed. Right after a Redis restart every presence
    is gone with the data, not lapsed: none is reported until live workers have had a
    presence's lifetime to write theirs again."""
    if not names:
        return set()
    try:
        uptime = redis.info("server").get("uptime_in_seconds")
    except ResponseError:  # INFO refused (some managed Redis): a lapse is not told apart
        return set()  # from a restart, so the leases decide
    if isinstance(uptime, int) and uptime < 2 * ttl_seconds:
        return set()
    values = redis.mget([PRESENCE_KEY.format(name=n) for n in names])
    return {name for name, value in zip(names, values, strict=True) if value is None}


def live_workers(redis: Redis[bytes]) -> list[dict[str, Any]]:
    """The registry entries of the workers consuming now."""
    indexed = redis.zrange(WORKER_INDEX, 0, -1, withscores=True)
    if not indexed:
        return []
    values = redis.mget([WORKER_KEY.format(name=name.decode()) for name, _ in indexed])
    old = time.time() - INDEX_PRUNE_SECONDS
    stale = [name for (name, score), v in zip(indexed, values, strict=True) if v is None and score < old]
    if stale:
        redis.zrem(WORKER_INDEX, *stale)
    return [json.loads(v) for v in values if v]


def live_capacities(redis: Redis[bytes], model: str) -> list[int]:
    """The in-flight capacity (jobs at once) of each live worker serving `model`."""
    return [int(w.get("capacity") or 0) for w in live_workers(redis) if w.get("model") == model]


class HealthService:
    def __init__(self, db: Database, redis: Redis[bytes], served: Callable[[], frozenset[str]]) -> None:
        """`served`: the served models now (app/services/models.py's registry)."""
        self._db = db
        self._redis = redis
        self._served = served

    def readiness(self, *, details: bool = True) -> Readiness:
        """Database, Redis and consuming workers. Without `details`, workers are counted
        per model only: no names (they hold host names and pids) and no per-worker figures."""
        checks: dict[str, Any] = {}
        start = time.perf_counter()
        try:
            with self._db.session() as s:
                s.execute(text("SELECT 1"))
            checks["database"] = {"ok": True, "ms": round((time.perf_counter() - start) * 1e3, 1)}
        except Exception as exc:  # noqa: BLE001 - readiness reports, never raises
            checks["database"] = {"ok": False, "error": type(exc).__name__}
        start = time.perf_counter()
        workers: list[dict[str, Any]] = []
        try:
            self._redis.ping()
            checks["redis"] = {"ok": True, "ms": round((time.perf_counter() - start) * 1e3, 1)}
            workers = live_workers(self._redis)
        except Exception as exc:  # noqa: BLE001
            checks["redis"] = {"ok": False, "error": type(exc).__name__}
        served = self._served()
        consuming = [w for w in workers if w.get("model") in served and w.get("consuming")]
        per_model = dict.fromkeys(sorted(served), 0)
        for w in consuming:
            per_model[str(w.get("model"))] += 1
        checks["workers"] = {"ok": bool(consuming), "consuming": len(consuming), "per_model": per_model}
        if details:
            checks["workers"]["workers"] = [
                {
                    k: w.get(k)
                    for k in ("name", "model", "inflight", "capacity", "engine", "host", "metrics_port")
                }
                for w in workers
            ]
        return Readiness(all(c["ok"] for c in checks.values()), checks)
