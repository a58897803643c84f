"""Keep the worker alive when its Redis connection is lost (Celery 5.7, kombu 5.7).

On a lost connection Celery closes the channel after releasing its connection; kombu's
Redis QoS then fails with AttributeError (`conninfo` is None) when it restores unacked
messages, and again when a task that was running across the reconnect acks or rejects its
message on the dead channel. Either one is "unrecoverable" to Celery: the worker exits in
the middle of its jobs. The messages in question cannot be acked on a connection that no
longer exists, and nothing is lost by not doing so: Postgres leases and the sweeper recover
every job, and the claim guard makes a redelivery harmless. So those calls are allowed to
fail quietly, with a log line.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("llmq.worker")


def _tolerant(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except AttributeError as exc:
            log.warning(
                "broker channel already gone; %s skipped, the sweeper covers its jobs",
                name,
                extra={"error": str(exc)},
            )
            return None

    call._llmq_tolerant = True  # type: ignore[attr-defined]
    return call


def survive_broker_loss() -> None:
    from kombu.transport import redis as kombu_redis

    for name in ("restore_unacked_once", "ack", "reject"):
        method = getattr(kombu_redis.QoS, name)
        if not getattr(method, "_llmq_tolerant", False):
            setattr(kombu_redis.QoS, name, _tolerant(name, method))
