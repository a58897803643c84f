"""How many Postgres connections each llmq process may open: the one formula the README's
"Connection budget" section states, computed here and nowhere else.

    API process  = LLMQ_DB_POOL_SIZE        + LLMQ_DB_MAX_OVERFLOW      (10 + 4 = 14)
    API replica  = LLMQ_API_WORKERS × API process                        (2 × 14 = 28)
    worker       = LLMQ_WORKER_DB_POOL_SIZE + LLMQ_DB_MAX_OVERFLOW
                   + webhook delivery's own pool                       (8 + 4 + 2 = 14)
    fleet        = replicas × API replica + workers × worker + ADMIN_CONNECTIONS

Every API process holds exactly one SQLAlchemy engine (app/db.py); the upload's COPY
borrows from it and downloads page through it. A worker holds two: its jobs' pool and
webhook delivery's (WEBHOOK_POOL), which is its own so that a slow receiver never holds
a job's connection. Nothing else opens a connection: `llmq migrate`
uses one unpooled connection and a CLI call (`llmq key`) a pool of one, both counted in
ADMIN_CONNECTIONS with room for an operator's psql. A worker's threads hold a connection
for one short transaction each (a claim, a finish, a chunk of batch lines), so its pool
is far smaller than its in-flight jobs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

from redis import Redis
from redis.backoff import NoBackoff
from redis.client import PubSub
from redis.driver_info import DriverInfo
from redis.retry import Retry

from app.settings import Settings

# `llmq migrate`, a CLI call, an operator's psql and a monitoring check, at once.
ADMIN_CONNECTIONS = 4


@dataclass(frozen=True)
class PoolSize:
    """One process's pool: `pool` connections kept open, `overflow` more opened under load
    and closed once unused for a while (app/db.py, KeptOverflowPool)."""

    pool: int
    overflow: int

    @property
    def total(self) -> int:
        return self.pool + self.overflow

    def describe(self) -> str:
        return (
            f"postgres connections: up to {self.total} "
            f"(pool {self.pool} + overflow {self.overflow}) per process"
        )


# Webhook delivery's pool in each worker (app/services/webhook_delivery.py): a claim and a
# record at a time per delivery thread round, never held across an HTTP call.
WEBHOOK_POOL = PoolSize(pool=2, overflow=0)

# A short-lived admin process (`llmq key`, `llmq up`'s key bootstrap): one connection.
ADMIN_POOL = PoolSize(pool=1, overflow=0)


def api_pool(settings: Settings) -> PoolSize:
    """One API (gunicorn worker) process's pool."""
    return PoolSize(pool=settings.db_pool_size, overflow=settings.db_max_overflow)


def worker_pool(settings: Settings) -> PoolSize:
    """One worker process's pool for its jobs (webhook delivery's is WEBHOOK_POOL)."""
    return PoolSize(pool=settings.worker_db_pool_size, overflow=settings.db_max_overflow)


def worker_connections(settings: Settings) -> int:
    """Every connection one worker process may open: its jobs' pool and webhook delivery's."""
    return worker_pool(settings).total + WEBHOOK_POOL.total


@dataclass(frozen=True)
class Fleet:
    """A deployment's shape: API replicas (each `llmq api` with LLMQ_API_WORKERS gunicorn
    processes) and worker processes (one per GPU)."""

    api_replicas: int
    workers: int

    def connections(self, settings: Settings) -> int:
        """The most Postgres connections the fleet can open at once."""
        api = self.api_replicas * settings.api_workers * api_pool(settings).total
        return api + self.workers * worker_connections(settings) + ADMIN_CONNECTIONS


# The fleet the README documents and the `max_connections` suggested for it: two API
# replicas and eight GPU workers, at default settings, with room under Postgres's own
# superuser_reserved_connections (3).
DOCUMENTED_FLEET = Fleet(api_replicas=2, workers=8)
SUGGESTED_MAX_CONNECTIONS = 200
POSTGRES_RESERVED_CONNECTIONS = 3


# What every connection tells Redis it is (CLIENT SETINFO), found once per process: left to
# redis-py, each new connection reads the package's metadata from disk again (about 0.5 ms
# of CPU, nearly half of opening one), and a burst opens dozens at once: B1's 64 submits
# grew the API's pools by 54 connections and the worker's by 21.
_DRIVER = DriverInfo()


def _redis(url: str, **options: Any) -> Redis[bytes]:
    # types-redis predates the argument (redis-py 8).
    client = Redis.from_url(url, driver_info=_DRIVER, **options)  # type: ignore[call-overload]
    return cast("Redis[bytes]", client)


def redis_client(url: str) -> Redis[bytes]:
    """A process's Redis client: bounded connect and read waits, idle connections checked."""
    return _redis(url, socket_timeout=10, socket_connect_timeout=5, health_check_interval=30)


def pubsub(redis: Redis[bytes], *, ignore_subscribe_messages: bool = False) -> PubSub:
    """`redis.pubsub()`, its messages handed over as they are read. Under RESP3 (redis-py
    8's default) a PubSub made without a push handler leaves the parser's default one,
    which builds `str()` of every message and looks its logger up (under logging's lock) to
    log it at DEBUG, which nothing shows: `getLogger` was 4.3 % of an API process's py-spy
    samples while it relayed B5's streams, each chunk announced by one message (the API's
    CPU per stream job moved within the noise)."""
    # types-redis predates the argument (redis-py 5).
    return redis.pubsub(  # type: ignore[call-arg]
        push_handler_func=_as_read, ignore_subscribe_messages=ignore_subscribe_messages
    )


def _as_read(response: Any) -> Any:
    return response


def quick_redis_client(url: str) -> Redis[bytes]:
    """For reads that have a fallback (the API's key cache): one try, short waits. The
    default client retries a refused connection for about 3.5 s, which every request would
    wait out while Redis is down."""
    return _redis(
        url, socket_timeout=1, socket_connect_timeout=1, health_check_interval=30, retry=Retry(NoBackoff(), 0)
    )
