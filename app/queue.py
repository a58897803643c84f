"""The broker side: Celery configuration shared by producer and worker, and the producer.

The API sends tasks by name (`llmq.run_job`), so it never imports worker code. A message
only names a job id; the job itself lives in Postgres. After a message is sent, a marker
key says so; the sweeper re-sends a queued job whose marker is gone (Redis restarted, or
the API died between commit and send). A message that a worker took but never claimed
(the worker died first) sits in the broker's unacknowledged set until the visibility
timeout, hours away: the sweeper finds such deliveries, drops them and sends again. A
worker that dies between taking a message off the queue and recording the delivery loses it
outright, marker or not: a queued job that no delivery names while its queue is empty is
sent again too.
"""

from __future__ import annotations

import base64
import json
import re
import time
from collections.abc import Sequence
from typing import Any

from celery import Celery
from redis import Redis

from app.settings import Settings

RUN_JOB_TASK = "llmq.run_job"
RUN_JOBS_TASK = "llmq.run_jobs"
SENT_MARKER = "llmq:sent:{job_id}"
# kombu's Redis transport: delivered, unacknowledged messages and their delivery times.
UNACKED = "unacked"
UNACKED_INDEX = "unacked_index"

# Redis lists per priority; 0 is consumed first.
PRIORITY_STEPS = list(range(10))
SINGLE_JOB_BASE = 3  # single jobs ahead of batch lines
BATCH_LINE_BASE = 6


def queue_name(model: str) -> str:
    """One queue per served model, so a worker only takes jobs its engine can run."""
    return "llmq." + re.sub(r"[^A-Za-z0-9_.-]", "_", model)


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


def create_producer(settings: Settings) -> Celery:
    app = Celery("llmq-producer", set_as_current=False)
    app.conf.update(celery_config(settings))
    return app


class JobQueue:
    """Sends job messages and keeps the marker that proves a message exists."""

    def __init__(self, celery: Celery, redis: Redis[bytes], *, marker_ttl_seconds: int) -> None:
        self._celery = celery
        self._redis = redis
        self._marker_ttl = marker_ttl_seconds

    def enqueue(self, job_id: str, model: str, priority: int, *, batch_line: bool = False) -> None:
        """Send one message naming `job_id`. Raises redis/kombu errors when Redis is down."""
        self._celery.send_task(
            RUN_JOB_TASK,
            args=[job_id],
            queue=queue_name(model),
            priority=broker_priority(priority, batch_line=batch_line),
        )
        self._redis.set(SENT_MARKER.format(job_id=job_id), 1, ex=self._marker_ttl)

    def enqueue_chunk(self, job_ids: list[str], model: str, priority: int) -> None:
        """One message for a chunk of batch lines, run together by one worker."""
        self._celery.send_task(
            RUN_JOBS_TASK,
            args=[job_ids],
            queue=queue_name(model),
            priority=broker_priority(priority, batch_line=True),
        )
        pipe = self._redis.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.set(SENT_MARKER.format(job_id=job_id), 1, ex=self._marker_ttl)
        pipe.execute()

    def forget(self, *job_ids: str) -> None:
        """Drop the markers once the jobs are claimed or finished."""
        if job_ids:
            self._redis.delete(*(SENT_MARKER.format(job_id=j) for j in job_ids))

    def depth(self, model: str) -> int:
        """Messages waiting in the model's queue, all priorities."""
        name = queue_name(model)
        pipe = self._redis.pipeline(transaction=False)
        for step in PRIORITY_STEPS:
            pipe.llen(name if step == 0 else f"{name}:{step}")
        return sum(pipe.execute())

    def delivered_job_ids(self) -> set[str]:
        """Every job id that an unacknowledged delivery names."""
        return {job_id for ids in self._deliveries("+inf", limit=100_000).values() for job_id in ids}

    def stale_deliveries(self, older_than_seconds: float, limit: int = 1000) -> dict[str, list[str]]:
        """Messages a worker took over `older_than_seconds` ago and has not acknowledged:
        {delivery tag: the job ids they name}. A running job's message is among them."""
        return self._deliveries(time.time() - older_than_seconds, limit=limit)

    def _deliveries(self, before: float | str, *, limit: int) -> dict[str, list[str]]:
        """Unacknowledged deliveries made before `before` (a time, or "+inf" for all)."""
        tags = self._redis.zrangebyscore(UNACKED_INDEX, "-inf", before, start=0, num=limit)
        if not tags:
            return {}
        found = {}
        for tag, raw in zip(tags, self._redis.hmget(UNACKED, tags), strict=True):
            job_ids = _job_ids(raw) if raw is not None else None
            if job_ids is not None:
                found[tag.decode()] = job_ids
        return found

    def drop_deliveries(self, tags: Sequence[str]) -> None:
        """Forget deliveries for good: the broker will not hand them out again."""
        if tags:
            pipe = self._redis.pipeline()
            pipe.zrem(UNACKED_INDEX, *tags)
            pipe.hdel(UNACKED, *tags)
            pipe.execute()

    def missing_markers(self, job_ids: Sequence[str]) -> list[str]:
        """The ids among `job_ids` with no live message marker."""
        if not job_ids:
            return []
        pipe = self._redis.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.exists(SENT_MARKER.format(job_id=job_id))
        return [j for j, exists in zip(job_ids, pipe.execute(), strict=True) if not exists]


def _job_ids(raw: bytes) -> list[str] | None:
    """The job ids an unacknowledged message names; None for anything else."""
    try:
        message = json.loads(raw)[0]
        body = message["body"]
        if message["properties"].get("body_encoding") == "base64":
            body = base64.b64decode(body)
        args = json.loads(body)[0]
        task = message["headers"]["task"]
    except (ValueError, KeyError, IndexError, TypeError):
        return None
    if task == RUN_JOB_TASK and args and isinstance(args[0], str):
        return [args[0]]
    if task == RUN_JOBS_TASK and args and isinstance(args[0], list):
        return [str(j) for j in args[0]]
    return None
