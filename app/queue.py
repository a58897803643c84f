"""The broker side: Celery configuration shared by producer and worker, and the producer.

The API sends tasks by name (`llmq.run_job`), so it never imports worker code. A message
only names a job id; the job itself lives in Postgres. Whether a job's message is live,
and what is done when it is not, is app/liveness.py's.
"""

from __future__ import annotations

import hashlib
import re
from typing import TYPE_CHECKING, Any

from celery import Celery

from app.request_ids import MESSAGE_HEADER
from app.settings import Settings

if TYPE_CHECKING:  # app.liveness reads the names below
    from app.liveness import Liveness

RUN_JOB_TASK = "llmq.run_job"
RUN_JOBS_TASK = "llmq.run_jobs"

# Redis lists per priority; 0 is consumed first.
PRIORITY_STEPS = list(range(10))
SINGLE_JOB_BASE = 3  # single jobs ahead of batch lines
BATCH_LINE_BASE = 6


def queue_name(model: str) -> str:
    """One queue per served model, so a worker only takes jobs its engine can run. A name
    with characters a queue name cannot hold (`org/model`) gets a digest of the name too,
    so two models never share a queue (`org/model` and `org_model`)."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", model)
    if safe != model:
        safe += "-" + hashlib.sha256(model.encode()).hexdigest()[:8]
    return "llmq." + safe


def broker_priority(job_priority: int, *, batch_line: bool = False) -> int:
    """Map a request `priority` (lower runs earlier, default 0) onto the broker's 0..9."""
    base = BATCH_LINE_BASE if batch_line else SINGLE_JOB_BASE
    return max(0, min(9, base + job_priority))


def celery_config(settings: Settings) -> dict[str, Any]:
    """What producer and worker must agree on."""
    return {
        "broker_url": settings.require_redis_url(),
        "broker_connection_retry_on_startup": True,
        "broker_transport_options": {
            "visibility_timeout": settings.visibility_timeout_seconds,
            "priority_steps": PRIORITY_STEPS,
            "sep": ":",
            "queue_order_strategy": "priority",
        },
        "task_serializer": "json",
        "accept_content": ["json"],
        "task_ignore_result": True,
        "result_backend": None,
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "task_default_priority": SINGLE_JOB_BASE,
        "worker_cancel_long_running_tasks_on_connection_loss": True,
    }


def reuse_broker_clients() -> None:
    """One redis-py client per kombu channel and pool, not one per broker call.

    kombu's Redis channel builds a new `redis.Redis` for every publish, acknowledgement and
    QoS step (`Channel._create_client`), and redis-py 8 spends about 130 µs building one
    (its table of response callbacks): a few times per job, in the API and in the worker.
    The client object holds no connection of its own (its pool does), so one per channel
    does the same work; a channel whose pool is replaced (after a reconnect) gets a new one.
    The asynchronous client (BRPOP) is kombu's own, already kept per channel."""
    from kombu.transport import redis as kombu_redis

    create = kombu_redis.Channel._create_client
    if getattr(create, "_llmq_reused", False):
        return

    def _create_client(self: Any, asynchronous: bool = False) -> Any:
        if asynchronous:
            return create(self, asynchronous=True)
        pool = self.pool
        client = self.__dict__.get("_llmq_client")
        if client is None or client.connection_pool is not pool:
            client = create(self)
            self.__dict__["_llmq_client"] = client
        return client

    _create_client._llmq_reused = True  # type: ignore[attr-defined]
    kombu_redis.Channel._create_client = _create_client


def create_producer(settings: Settings) -> Celery:
    reuse_broker_clients()
    app = Celery("llmq-producer", set_as_current=False)
    app.conf.update(celery_config(settings))
    return app


class JobQueue:
    """Sends job messages; `liveness` records that each one exists (app/liveness.py)."""

    def __init__(self, celery: Celery, liveness: Liveness) -> None:
        self._celery = celery
        self._liveness = liveness

    def enqueue(
        self,
        job_id: str,
        model: str,
        priority: int,
        *,
        batch_line: bool = False,
        request_id: str | None = None,
    ) -> None:
        """Send one message naming `job_id`, with the request id that created the job in its
        headers (for tracing; the worker's log lines take the id stored on the job). Raises
        redis/kombu errors when Redis is down."""
        self._celery.send_task(
            RUN_JOB_TASK,
            args=[job_id],
            queue=queue_name(model),
            priority=broker_priority(priority, batch_line=batch_line),
            headers={MESSAGE_HEADER: request_id} if request_id else None,
        )
        self._liveness.sent([job_id])

    def enqueue_chunk(self, job_ids: list[str], model: str, priority: int) -> None:
        """One message for a chunk of batch lines, run together by one worker."""
        self._celery.send_task(
            RUN_JOBS_TASK,
            args=[job_ids],
            queue=queue_name(model),
            priority=broker_priority(priority, batch_line=True),
        )
        self._liveness.sent(job_ids)
