"""Builds the service graph from settings, once per process."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from redis import Redis

from app.connections import api_pool
from app.db import Database
from app.events import JobEvents
from app.liveness import Liveness
from app.queue import JobQueue, create_producer
from app.schemas.chat import ChatCompletionV2Request
from app.services.batches import BatchService
from app.services.chat import ChatService
from app.services.contract import RequestPolicy
from app.services.files import FileService
from app.services.health import HealthService
from app.services.idempotency import IdempotencyLocks
from app.services.jobs import JobService
from app.services.keys import KeyService
from app.services.limits import RateLimiter
from app.services.metrics import MetricsService
from app.services.notifier import Notifier
from app.services.sandbox import ConstraintSandbox
from app.services.slots import StreamSlots
from app.services.streaming import StreamService
from app.settings import Settings

if TYPE_CHECKING:
    from app.services.template_sandbox import TemplateSandbox

log = logging.getLogger("llmq.api")


@dataclass
class Services:
    settings: Settings
    db: Database
    redis: Redis[bytes]
    queue: JobQueue
    liveness: Liveness
    events: JobEvents
    keys: KeyService
    jobs: JobService
    streams: StreamService
    chat: ChatService
    files: FileService
    batches: BatchService
    health: HealthService
    metrics: MetricsService
    limiter: RateLimiter
    slots: StreamSlots
    auth_failures: RateLimiter
    constraints: ConstraintSandbox | None = None
    # The served model's context length: LLMQ_MAX_MODEL_LEN, else the model folder's config.
    max_model_len: int | None = None

    @property
    def served_models(self) -> frozenset[str]:
        return frozenset({self.settings.model_name})

    def close(self) -> None:
        self.db.dispose()
        self.redis.close()
        if self.constraints is not None:
            self.constraints.close()


def redis_client(url: str) -> Redis[bytes]:
    return Redis.from_url(url, socket_timeout=10, socket_connect_timeout=5, health_check_interval=30)


# The config keys vLLM derives a model's context length from (the smallest one present).
_CONTEXT_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "model_max_length",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)


def model_context(settings: Settings) -> int | None:
    """The served model's context length in tokens: the configured one, else what its
    local folder's config.json says; None for a model known only by name."""
    if settings.max_model_len:
        return settings.max_model_len
    config_file = Path(settings.model) / "config.json" if settings.model else None
    if config_file is None or not config_file.is_file():
        return None
    config = json.loads(config_file.read_text())
    for section in (config, config.get("text_config") or {}):
        found = [int(v) for k in _CONTEXT_KEYS if isinstance(v := section.get(k), int) and v > 0]
        if found:
            return min(found)
    return None


def prompt_counter(settings: Settings) -> tuple[Callable[[ChatCompletionV2Request], int] | None, int | None]:
    """Token counting with the model's own tokenizer and template, when the model is a
    local folder (and counting is on): (count, context length)."""
    folder = Path(settings.model) if settings.model else None
    if not settings.api_counts_prompt_tokens or folder is None or not (folder / "config.json").is_file():
        return None, None
    from app.domain.prompts import ChatRenderer
    from app.domain.tools import plan_tools

    # gevent workers: a render with user input must never run in this process (it would
    # block every greenlet); the sandbox children render it under the time limit.
    renderer = ChatRenderer.load(
        str(folder),
        sandbox=template_sandbox(settings, str(folder)),
        custom_templates=False,  # the API does not count user templates (the worker renders them)
        inprocess_max_bytes=settings.inprocess_render_max_bytes,
    )
    context = model_context(settings)

    def count(req: ChatCompletionV2Request) -> int:
        return len(renderer.render(req, plan_tools(req, auto_parser=settings.tool_call_parser)))

    return count, int(context) if context else None


def template_sandbox(settings: Settings, model: str, *, wait_seconds: float | None = None) -> TemplateSandbox:
    from app.services.template_sandbox import TemplateSandbox

    return TemplateSandbox(
        model,
        timeout=settings.chat_template_timeout_seconds,
        max_output=settings.max_body_bytes * 4,
        processes=settings.template_sandbox_processes,
        wait_seconds=wait_seconds,
    )


def model_vocab_size(settings: Settings) -> int | None:
    """The model's vocabulary size (the logits' width, what vLLM checks token ids against),
    when the model is a local folder."""
    config = Path(settings.model) / "config.json" if settings.model else None
    if config is None or not config.is_file():
        return None
    data = json.loads(config.read_text())
    size = data.get("vocab_size") or (data.get("text_config") or {}).get("vocab_size")
    return int(size) if size else None


def build_services(settings: Settings) -> Services:
    pool = api_pool(settings)
    db = Database.from_settings(settings, pool, pool_timeout=settings.db_pool_timeout_seconds)
    log.info(pool.describe(), extra={"pool": pool.pool, "overflow": pool.overflow, "role": "api"})
    redis = redis_client(settings.require_redis_url())
    liveness = Liveness(redis, marker_ttl_seconds=settings.visibility_timeout_seconds, db=db)
    queue = JobQueue(create_producer(settings), liveness)
    events = JobEvents(redis)
    served = frozenset({settings.model_name})
    keys = KeyService(db)
    count, context = prompt_counter(settings)
    constraints = ConstraintSandbox.of(settings)
    policy = RequestPolicy(
        settings,
        served,
        count_prompt=count,
        max_model_len=context,
        vocab_size=model_vocab_size(settings),
        constraints=constraints,
    )
    locks = IdempotencyLocks(redis)
    jobs = JobService(
        db,
        queue,
        events,
        policy,
        cancel_wait_seconds=settings.cancel_wait_seconds,
        locks=locks,
        idempotency_ttl_seconds=settings.idempotency_ttl_seconds,
        max_active_per_tenant=settings.max_active_jobs_per_tenant,
    )
    streams = StreamService(
        db,
        redis,
        Notifier(redis),
        keys,
        heartbeat_seconds=settings.sse_heartbeat_seconds,
        key_check_seconds=settings.stream_key_check_seconds,
    )
    return Services(
        settings=settings,
        db=db,
        redis=redis,
        queue=queue,
        liveness=liveness,
        events=events,
        keys=keys,
        jobs=jobs,
        streams=streams,
        chat=ChatService(jobs, streams, wait_seconds=settings.sync_wait_seconds),
        files=FileService(db, policy, settings),
        batches=BatchService(
            db,
            events,
            locks=locks,
            idempotency_ttl_seconds=settings.idempotency_ttl_seconds,
            max_active_lines_per_tenant=settings.max_active_batch_lines_per_tenant,
        ),
        health=HealthService(db, redis, served),
        metrics=MetricsService(db, redis, liveness, served),
        limiter=RateLimiter(
            redis, per_minute=settings.rate_limit_per_minute, burst=settings.rate_limit_burst
        ),
        constraints=constraints,
        auth_failures=RateLimiter(
            redis,
            per_minute=settings.auth_failures_per_minute,
            burst=settings.auth_failure_burst,
            scope="authfail",
            subject_name="failed authentications per minute reached for this client address",
        ),
        slots=StreamSlots(redis, per_key=settings.max_streams_per_key),
        max_model_len=model_context(settings),
    )
