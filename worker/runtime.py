"""Everything one worker process holds: the engine on its loop thread, the runner, and the
background threads. Built once per process from the Celery `worker_init` signal."""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from app.connections import WEBHOOK_POOL, redis_client, worker_pool
from app.db import Database
from app.domain.prompts import ChatRenderer
from app.events import JobEvents
from app.liveness import Liveness
from app.periodic import Periodic
from app.queue import JobQueue, create_producer, wake_feeder
from app.services.addresses import system_resolver
from app.services.batch_export import BatchExports
from app.services.batch_lifecycle import BatchLifecycle
from app.services.expiry import FileExpiry
from app.services.health import absent_workers, live_capacities
from app.services.model_files import local_folder, read_config, vocab_size
from app.services.object_store import store_from_settings
from app.services.sandbox import ConstraintSandbox
from app.services.webhook_delivery import DeliveryConfig, WebhookDeliverer
from app.settings import Settings
from app.threads import name_native_thread
from worker.batches import BatchScheduler
from worker.control import LeaseKeeper, Presence, RegistryHeartbeat, SignalListener
from worker.engine import Engine, InstantEngine
from worker.expiry import ExpiryTask
from worker.leader import LeaseLock
from worker.loop import LoopThread
from worker.metrics import MetricsServer, WorkerMetrics, WorkerState
from worker.runner import JobRunner, RunnerConfig
from worker.stats import ProcessTree, ResourceSampler, find_power_sensor
from worker.store import JobStore
from worker.streaming import StreamPublisher
from worker.sweeper import Sweeper
from worker.translate import Renderer

log = logging.getLogger("llmq.worker")

_current: WorkerRuntime | None = None

# How long a paused or partitioned leader keeps the sweeper or the batch scheduler to itself.
LEADER_LEASE_SECONDS = 20.0


def current() -> WorkerRuntime:
    if _current is None:
        raise RuntimeError("worker runtime not started (is this running inside `python -m worker`?)")
    return _current


def set_current(runtime: WorkerRuntime | None) -> None:
    global _current
    _current = runtime


def default_worker_name() -> str:
    return f"llmq@{socket.gethostname()}:{os.getpid()}"


def model_fingerprint(engine: Engine, model: str | None) -> str:
    """Engine version + model revision (hash of its config), OpenAI's `system_fingerprint`."""
    digest = hashlib.sha256(f"{engine.name}-{engine.version}".encode())
    if model and (Path(model) / "config.json").is_file():
        digest.update((Path(model) / "config.json").read_bytes())
    elif model:
        digest.update(model.encode())
    return f"fp_{engine.name}-{engine.version}-{digest.hexdigest()[:10]}"


def build_engine(settings: Settings) -> tuple[Engine, Renderer]:
    """The configured engine and the prompt renderer that goes with it."""
    if settings.engine == "instant":
        from worker.engine import ByteRenderer

        return InstantEngine(
            context=settings.max_model_len or 4096, delay=settings.instant_token_seconds
        ), ByteRenderer()
    if settings.engine == "simulated":
        from worker.engine import ByteRenderer
        from worker.sim_engine import simulated_engine

        return simulated_engine(settings), ByteRenderer()
    from app.container import template_sandbox
    from app.domain.prompts import ChatRenderer
    from worker.vllm_engine import VllmEngine

    if not settings.model:
        raise RuntimeError("LLMQ_MODEL is not set: point it at a model folder or name")
    # A worker thread may render the model's own template in-process up to the request
    # bound (no event loop to block, and big prompts are its ordinary work); a job waits
    # for a free sandbox under its renewed lease rather than failing as busy.
    renderer = ChatRenderer.load(
        settings.model,
        sandbox=template_sandbox(settings, settings.model, wait_seconds=settings.job_timeout_seconds),
        custom_templates=settings.allow_custom_chat_template,
        inprocess_max_bytes=settings.max_request_bytes,
    )
    return VllmEngine(settings), renderer


class WorkerRuntime:
    def __init__(
        self,
        settings: Settings,
        engine: Engine,
        renderer: Renderer,
        *,
        name: str | None = None,
        consuming: Callable[[], bool] = lambda: True,
    ) -> None:
        self.settings = settings
        self.name = name or default_worker_name()
        self.engine = engine
        pool = worker_pool(settings)
        self.db = Database.from_settings(settings, pool)
        log.info(pool.describe(), extra={"pool": pool.pool, "overflow": pool.overflow, "role": "worker"})
        self.redis = redis_client(settings.require_redis_url())
        self.events = JobEvents(self.redis)
        self.store = JobStore(self.db)
        self.liveness = Liveness(
            self.redis, marker_ttl_seconds=settings.visibility_timeout_seconds, db=self.db
        )
        self.queue = JobQueue(create_producer(settings), self.liveness)
        self.loop = LoopThread()
        # The worker's processes, found again every half minute (not each sample): their
        # memory on CPU, and on GPU which of the device's processes are this worker's.
        processes = ProcessTree(self._pids)
        self.sampler = ResourceSampler(processes, find_power_sensor(processes.pids))
        self.metrics = WorkerMetrics(
            WorkerState(
                model=settings.model_name,
                engine=engine.name,
                engine_version=engine.version,
                running=lambda: len(self.runner.inflight()),
                slots=settings.inflight_limit,
                energy=self.sampler.energy_joules if self.sampler.has_power else None,
            )
        )
        self.metrics_server = MetricsServer(
            self.metrics, port=settings.metrics_port, address=settings.metrics_address
        )
        self.streams = StreamPublisher(self.redis)
        self.constraints = ConstraintSandbox.of(settings)
        self.runner = JobRunner(
            self.store,
            engine,
            self.loop,
            renderer,
            self.sampler,
            self.streams,
            RunnerConfig(
                worker_name=self.name,
                lease_seconds=settings.lease_seconds,
                max_attempts=settings.max_attempts,
                job_timeout_seconds=settings.job_timeout_seconds,
                system_fingerprint=model_fingerprint(engine, settings.model),
                tool_parser=settings.tool_call_parser,
                max_inflight=settings.inflight_limit,
                max_request_bytes=settings.max_request_bytes,
                quiet_stream_interval=settings.quiet_stream_interval,
                observe=self.metrics.observe,
            ),
            constraints=self.constraints,
        )
        self.streams.on_heard = self.runner.hasten
        self.sweeper = Sweeper(
            self.db,
            self.store,
            self.queue,
            self.liveness,
            self.events,
            max_attempts=settings.max_attempts,
            grace_seconds=settings.requeue_grace_seconds,
            interval_seconds=settings.sweeper_interval_seconds,
            lock=self._leader_lock("sweeper"),
            absent=self._absent,
            presence_check_seconds=settings.worker_presence_ttl_seconds / 5,
        )
        self.batches = BatchScheduler(
            self._leader_lock("batches"),
            BatchLifecycle(
                self.db,
                self.queue,
                self.events,
                chunk=settings.batch_chunk_size,
                window=settings.batch_dispatch_window,
                capacities=lambda model: live_capacities(self.redis, model),
                headroom=settings.batch_dispatch_headroom,
                cold_window=settings.batch_cold_window,
            ),
            tick_seconds=settings.batch_tick_seconds,
            idle_tick_seconds=settings.batch_idle_tick_seconds,
            redis=self.redis,
        )
        self.expiry = ExpiryTask(
            self._leader_lock("expiry"),
            FileExpiry(self.db, chunk=settings.expiry_chunk_rows),
            interval_seconds=settings.expiry_interval_seconds,
        )
        self.leases = LeaseKeeper(self.store, self.runner, self.name, settings.lease_seconds)
        self.signals = SignalListener(self.redis, self.runner, self.streams.watched)
        self.heartbeat = RegistryHeartbeat(
            self.redis, self.name, self.info, consuming, settings.worker_heartbeat_seconds
        )
        self.presence = Presence(self.redis, self.name, settings.worker_presence_ttl_seconds)
        # Webhooks go out from every worker, on threads and connections of their own, so a
        # slow receiver never holds a job thread or a job's database connection.
        self.webhook_db = Database.from_settings(settings, WEBHOOK_POOL)
        self.deliverer = WebhookDeliverer(
            self.webhook_db,
            system_resolver(settings.image_url_resolve_timeout_seconds),
            DeliveryConfig(
                connect_timeout=settings.webhook_connect_timeout_seconds,
                timeout=settings.webhook_timeout_seconds,
                concurrency=settings.webhook_concurrency,
                allow_private=settings.webhook_allow_private,
                schedule=settings.webhook_schedule,
            ),
        )
        self.webhooks = Periodic("llmq-webhooks", settings.webhook_poll_seconds, self.deliverer.tick, log=log)
        # Ended batches' outputs go to object storage on a thread of their own: a long
        # upload holds back neither the batch scheduler nor a job. A worker with no buckets
        # configured exports nothing (and so never builds a client for a store it was not
        # given); one that has them takes the exports.
        exports = BatchExports(self.db, store_from_settings(settings))
        self.exports = Periodic(
            "llmq-exports",
            settings.s3_export_poll_seconds,
            exports.export_due if settings.s3_buckets.strip() else lambda: 0,
            log=log,
        )
        # What the API needs to count prompts for this model: where its tokenizer is (the
        # folder or name this worker loaded; none for an engine without a tokenizer).
        self.tokenizer_source = settings.model if isinstance(renderer, ChatRenderer) else None
        self._vocab_size: int | None = None
        self._stopped = threading.Event()

    def wake_feeder(self) -> None:
        """A chunk of batch lines ended: the feeder sends the next lines now."""
        wake_feeder(self.redis)

    def _leader_lock(self, name: str) -> LeaseLock:
        """Taken over from a holder whose presence lapsed, not only when its lease ends."""
        return LeaseLock(
            self.redis,
            name,
            self.name,
            lease_seconds=LEADER_LEASE_SECONDS,
            holder_gone=lambda holder: bool(self._absent([holder])),
        )

    def _absent(self, owners: list[str]) -> set[str]:
        """Lease owners that are gone; never this worker, which is alive by definition."""
        others = [owner for owner in owners if owner != self.name]
        return absent_workers(self.redis, others, self.settings.worker_presence_ttl_seconds)

    def _pids(self) -> list[int]:
        return [os.getpid(), *self.engine.process_ids()]

    def vocab_size(self) -> int | None:
        """From the model's config.json (its folder, or the Hugging Face cache once the
        engine has downloaded it); None while unknown."""
        if self._vocab_size is None and self.tokenizer_source:
            self._vocab_size = vocab_size(read_config(local_folder(self.tokenizer_source)))
        return self._vocab_size

    def info(self) -> dict[str, Any]:
        """This worker's registry entry: the model it serves (name, context length from the
        engine, tokenizer source, vocabulary size when known) and its in-flight capacity.
        The API serves the models these entries name (app/services/models.py) and the batch
        feeder sizes its window from the capacities (app/services/dispatch.py)."""
        return {
            "name": self.name,
            "model": self.settings.model_name,
            "max_model_len": self.engine.max_model_len(),
            "tokenizer": self.tokenizer_source,
            "vocab_size": self.vocab_size(),
            "engine": "dead" if self.runner.engine_dead.is_set() else "ok",
            "inflight": len(self.runner.inflight()),
            "capacity": self.settings.inflight_limit,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            # Where Prometheus scrapes this worker (worker/metrics.py); None until it listens.
            "metrics_port": self.metrics_server.port,
        }

    def start(self) -> None:
        """Start the engine (blocks until it can serve) and the background threads."""
        self.presence.start()  # before any job can be claimed
        port = self.metrics_server.start()
        log.info("metrics listening", extra={"port": port, "address": self.settings.metrics_address})
        self.loop.start()
        log.info("starting engine", extra={"engine": self.engine.name, "model": self.settings.model_name})
        self.loop.call(self.engine.start())
        log.info("engine ready", extra={"max_model_len": self.engine.max_model_len()})
        # Before the consumer takes a job in all but a queue's first moments: its first burst
        # of claims finds them open.
        self.db.open_pool_in_background()
        self.sampler.start()
        self.streams.start()
        parts = (
            self.sweeper,
            self.batches,
            self.expiry,
            self.leases,
            self.signals,
            self.heartbeat,
            self.webhooks,
            self.exports,
        )
        for part in parts:
            part.start()
        threading.Thread(target=self._watch_engine, name="llmq-engine-watch", daemon=True).start()

    def consumer_ready(self) -> None:
        """Celery's consumer takes messages now: into the registry at once, not at the
        heartbeat's next round (the feeder sizes its window by the registry)."""
        self.heartbeat.kick()

    def _watch_engine(self) -> None:
        """An engine that died takes the worker down, so a supervisor restarts it and its
        jobs resume elsewhere; consuming more work here would only fail it."""
        name_native_thread()
        self.runner.engine_dead.wait()
        if self._stopped.is_set():
            return
        log.error("engine is dead; stopping this worker so it can be restarted")
        self.heartbeat.tick()
        os.kill(os.getpid(), signal.SIGTERM)

    def drain(self, grace_seconds: float) -> None:
        """On shutdown: let running jobs finish for `grace_seconds`, then hand the rest
        back to the queue (their finished work is not lost: they had none to save)."""
        released = self.runner.release_all(grace_seconds)
        if released:
            log.warning("released unfinished jobs on shutdown", extra={"count": released})

    def stop(self) -> None:
        self._stopped.set()
        for part in (
            self.exports,
            self.webhooks,
            self.presence,
            self.heartbeat,
            self.signals,
            self.leases,
            self.batches,
            self.expiry,
            self.sweeper,
            self.sampler,
            self.streams,
            self.metrics_server,
        ):
            part.stop()
        self.constraints.close()
        try:
            self.loop.call(self.engine.close(), timeout=30)
        except Exception as exc:  # noqa: BLE001 - shutting down anyway
            log.warning("engine close failed", extra={"error": str(exc)})
        self.loop.stop()
        self.deliverer.close()
        self.webhook_db.dispose()
        self.db.dispose()
