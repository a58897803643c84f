"""Builds the service graph from settings, once per process."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from redis import Redis

from app.connections import api_pool, quick_redis_client, redis_client
from app.db import Database
from app.events import JobEvents
from app.liveness import Liveness
from app.metrics import ApiMetrics, multiprocess_dir
from app.queue import JobQueue, create_producer, wake_feeder
from app.services.addresses import system_resolver
from app.services.batches import BatchService
from app.services.chat import ChatService
from app.services.completion_contract import CompletionPolicy
from app.services.contract import RequestPolicy
from app.services.files import FileService
from app.services.health import HealthService, live_workers
from app.services.idempotency import IdempotencyLocks
from app.services.jobs import JobService
from app.services.keys import KeyCache, KeyService
from app.services.limits import RateLimiter
from app.services.metrics import ClusterLease, MetricsService
from app.services.models import ModelRegistry, declared_models
from app.services.notifier import Notifier
from app.services.object_inputs import ObjectInputs
from app.services.object_store import store_from_settings
from app.services.results import ResultsService
from app.services.sandbox import ConstraintSandbox
from app.services.scale_batches import ScaleBatchService
from app.services.scale_completions import ScaleCompletionService
from app.services.slots import StreamSlots
from app.services.streaming import KeyWatch, StreamService
from app.services.text_completions import TextCompletionService
from app.services.throughput import ThroughputService
from app.services.tokenizers import PromptCounters
from app.services.webhooks import WebhookService
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
    text_completions: TextCompletionService
    scale: ScaleCompletionService
    files: FileService
    batches: BatchService
    scale_batches: ScaleBatchService
    results: ResultsService
    health: HealthService
    metrics: MetricsService
    limiter: RateLimiter
    slots: StreamSlots
    auth_failures: RateLimiter
    webhooks: WebhookService
    models: ModelRegistry
    throughput: ThroughputService
    constraints: ConstraintSandbox | None = None
    tokenizers: PromptCounters | None = None
    api_metrics: ApiMetrics = field(default_factory=ApiMetrics)

    @property
    def served_models(self) -> frozenset[str]:
        return self.models.names()

    def close(self) -> None:
        self.streams.close()
        self.db.dispose()
        self.redis.close()
        self.keys.close()
        if self.constraints is not None:
            self.constraints.close()
        if self.tokenizers is not None:
            self.tokenizers.close()


def replica_id(settings: Settings) -> str:
    """This API replica's name in the cluster-figures lease: the same for all its gunicorn
    processes (they share a PROMETHEUS_MULTIPROC_DIR), different from any other replica's."""
    return settings.metrics_replica_id or f"{socket.gethostname()}:{multiprocess_dir() or os.getpid()}"


def template_sandbox(settings: Settings, model: str, *, wait_seconds: float | None = None) -> TemplateSandbox:
    from app.services.template_sandbox import TemplateSandbox

    return TemplateSandbox(
        model,
        timeout=settings.chat_template_timeout_seconds,
        max_output=settings.max_body_bytes * 4,
        processes=settings.template_sandbox_processes,
        wait_seconds=wait_seconds,
    )


def build_services(settings: Settings, *, s3_client: Callable[[], Any] | None = None) -> Services:
    """`s3_client`: builds the object store's client (tests point it at their own store);
    by default boto3's, configured by the environment."""
    pool = api_pool(settings)
    db = Database.from_settings(
        settings, pool, pool_timeout=settings.db_pool_timeout_seconds, serves_requests=True
    )
    log.info(pool.describe(), extra={"pool": pool.pool, "overflow": pool.overflow, "role": "api"})
    redis = redis_client(settings.require_redis_url())
    liveness = Liveness(redis, marker_ttl_seconds=settings.visibility_timeout_seconds, db=db)
    queue = JobQueue(create_producer(settings), liveness)
    events = JobEvents(redis)
    keys = KeyService(
        db,
        redis=quick_redis_client(settings.require_redis_url()),
        cache=KeyCache(settings.auth_cache_seconds) if settings.auth_cache_seconds > 0 else None,
    )
    # Nothing model-specific is loaded here: the served app warms its tokenizers in the
    # background, else one is read on the first request that needs it
    # (app/services/tokenizers.py).
    tokenizers = (
        PromptCounters(settings, size=settings.api_tokenizer_cache_size)
        if settings.api_counts_prompt_tokens
        else None
    )
    models = ModelRegistry(
        lambda: live_workers(redis),
        declared=declared_models(settings),
        ttl_seconds=settings.model_registry_ttl_seconds,
        counters=tokenizers.counter if tokenizers is not None else None,
    )
    constraints = ConstraintSandbox.of(settings)
    api_metrics = ApiMetrics()
    policy = RequestPolicy(settings, models, constraints=constraints)
    completion_policy = CompletionPolicy(settings, models, constraints=constraints)
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
        submitted=api_metrics.count_submitted,
    )
    streams = StreamService(
        db,
        redis,
        Notifier(redis),
        keys,
        heartbeat_seconds=settings.sse_heartbeat_seconds,
        key_check_seconds=settings.stream_key_check_seconds,
    )
    files = FileService(db, policy, settings, completion_policy=completion_policy)
    store = store_from_settings(settings, s3_client)
    batches = BatchService(
        db,
        events,
        locks=locks,
        idempotency_ttl_seconds=settings.idempotency_ttl_seconds,
        max_active_lines_per_tenant=settings.max_active_batch_lines_per_tenant,
        batch_token_budget=settings.batch_token_budget,
        submitted=api_metrics.count_submitted,
        inputs=ObjectInputs(store, files, settings),
        created=lambda: wake_feeder(redis),
    )
    text_completions = TextCompletionService(
        jobs, streams, completion_policy, wait_seconds=settings.sync_wait_seconds
    )
    results = ResultsService(
        db,
        batches,
        KeyWatch(keys, settings.stream_key_check_seconds),
        poll_seconds=settings.results_poll_seconds,
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
        text_completions=text_completions,
        scale=ScaleCompletionService(text_completions, streams),
        files=files,
        batches=batches,
        scale_batches=ScaleBatchService(db, batches, files, models),
        results=results,
        health=HealthService(db, redis, models.names),
        metrics=MetricsService(
            db,
            redis,
            liveness,
            models.names,
            ClusterLease(redis, replica_id(settings), lease_seconds=settings.metrics_lease_seconds),
        ),
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
        webhooks=WebhookService(
            db,
            system_resolver(settings.image_url_resolve_timeout_seconds),
            allow_private=settings.webhook_allow_private,
            max_endpoints_per_tenant=settings.webhook_max_endpoints_per_tenant,
        ),
        models=models,
        throughput=ThroughputService(db),
        tokenizers=tokenizers,
        api_metrics=api_metrics,
    )
