"""The broker side: Celery configuration shared by producer and worker, and the producer.

The API sends tasks by name (`llmq.run_job`), so it never imports worker code. A message
only names a job id; the job itself lives in Postgres. Whether a job's message is live,
and what is done when it is not, is app/liveness.py's.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import re
import uuid
from bisect import bisect
from typing import TYPE_CHECKING, Any

from celery import Celery
from celery.utils.saferepr import saferepr
from redis.exceptions import RedisError

from app import tracing
from app.request_ids import MESSAGE_HEADER
from app.settings import Settings

if TYPE_CHECKING:  # app.liveness reads the names below
    from redis import Redis

    from app.liveness import Liveness

log = logging.getLogger("llmq.queue")

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


# The batch feeder's wake-up list (worker/batches.py): one element at most.
WAKE_KEY = "llmq:batches:wake"


def wake_feeder(redis: Redis[bytes]) -> None:
    """The batch feeder's next round runs now, not at its tick: a worker freed job slots,
    or the API created a batch (one round trip, never blocks, never raises: a wake-up lost
    to a Redis error only leaves the feeder to its tick)."""
    pipe = redis.pipeline(transaction=False)
    pipe.lpush(WAKE_KEY, b"1")
    pipe.ltrim(WAKE_KEY, 0, 0)
    try:
        pipe.execute()
    except RedisError as exc:
        log.debug("feeder wake-up not sent", extra={"error": type(exc).__name__})


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


class TaskMessages:
    """Celery task messages as kombu's Redis transport stores them, so that sending one is
    a single Redis call that also sets its jobs' markers (`Liveness.push`).

    The task message itself (protocol 2: headers, properties, body) is Celery's own
    (`app.amqp.create_task_message`, as `send_task` makes it); around it goes kombu's
    envelope, as its Redis channel writes it (`prepare_message`, `_inplace_augment_message`,
    `_put`): the body JSON and base64-encoded, a fresh delivery tag, the default exchange,
    and the list of the message's priority step (`<queue>:<step>`, the bare name for 0).
    tests/api/test_kombu_contract.py compares the two field by field, so a Celery or kombu
    upgrade that changes either breaks a test, not the workers.

    `send_task` did the same work through kombu's producer pool, connection retry and
    publish machinery: under gevent, 15-20 % of an API process's CPU per submitted job, and
    a round trip of its own before the markers' (bench.profile submit and stream)."""

    def __init__(self, celery: Celery) -> None:
        self._celery = celery
        options = celery.conf.broker_transport_options
        self._sep: str = options["sep"]
        self._steps: list[int] = list(options["priority_steps"])
        self._reply_to: str | None = None
        self._pid = 0

    def priority_list(self, queue: str, priority: int) -> str:
        """kombu's `_q_for_pri`: the list a message of `priority` waits in."""
        step = self._steps[bisect(self._steps, priority) - 1]
        return f"{queue}{self._sep}{step}" if step else queue

    def _argsrepr(self, args: list[Any]) -> str:
        """What Celery writes in `argsrepr` (its saferepr, cut at `argsrepr_maxsize`): for
        lists of ids that fit, their plain repr, at a fraction of saferepr's cost."""
        limit: int = self._celery.amqp.argsrepr_maxsize
        text = repr(args)
        return text if len(text) <= limit else str(saferepr(args, limit))

    def build(
        self, task: str, args: list[Any], *, queue: str, priority: int, headers: dict[str, str] | None = None
    ) -> str:
        """One message for `task(*args)`, as the JSON string kombu pushes."""
        if self._pid != os.getpid():  # the producer's id, per process as Celery's own
            self._pid, self._reply_to = os.getpid(), self._celery.thread_oid
        task_id = str(uuid.uuid4())
        message = self._celery.amqp.create_task_message(
            task_id,
            task,
            args,
            {},
            reply_to=self._reply_to,
            argsrepr=self._argsrepr(args),
            kwargsrepr="{}",
            ignore_result=None,
        )
        message_headers = dict(message.headers)
        if headers:
            message_headers.update(headers)
        body = json.dumps(list(message.body)).encode()
        properties = {
            **message.properties,
            "delivery_mode": 2,
            "delivery_info": {"exchange": "", "routing_key": queue},
            "priority": priority,
            "body_encoding": "base64",
            "delivery_tag": str(uuid.uuid4()),
        }
        return json.dumps(
            {
                "body": base64.b64encode(body).decode(),
                "content-encoding": "utf-8",
                "content-type": "application/json",
                "headers": message_headers,
                "properties": properties,
            }
        )


class JobQueue:
    """Sends job messages; `liveness` records that each one exists (app/liveness.py)."""

    def __init__(self, celery: Celery, liveness: Liveness) -> None:
        self._celery = celery
        self._liveness = liveness
        self._messages = TaskMessages(celery)

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
        self._send(
            RUN_JOB_TASK,
            [job_id],
            [job_id],
            model,
            broker_priority(priority, batch_line=batch_line),
            {MESSAGE_HEADER: request_id} if request_id else None,
        )

    def enqueue_chunk(self, job_ids: list[str], model: str, priority: int) -> None:
        """One message for a chunk of batch lines, run together by one worker."""
        self._send(RUN_JOBS_TASK, [job_ids], job_ids, model, broker_priority(priority, batch_line=True), None)

    def _send(
        self,
        task: str,
        args: list[Any],
        job_ids: list[str],
        model: str,
        priority: int,
        headers: dict[str, str] | None,
    ) -> None:
        queue = queue_name(model)
        if tracing.enabled():
            # Celery's publish, which the OpenTelemetry instrumentation wraps: its span's
            # context travels in the message's headers to the worker's task span.
            self._celery.send_task(task, args=args, queue=queue, priority=priority, headers=headers)
            self._liveness.sent(job_ids)
            return
        message = self._messages.build(task, args, queue=queue, priority=priority, headers=headers)
        self._liveness.push(self._messages.priority_list(queue, priority), message, job_ids)
