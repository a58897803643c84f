"""The worker's Celery app, built by a factory: threads pool sized to the in-flight limit,
one queue per served model, late acks, and the runtime started before consuming."""

from __future__ import annotations

import logging
import threading
from typing import Any

from celery import Celery, signals
from kombu import Queue

from app import tracing
from app.heap import freeze_startup_heap
from app.logs import configure_logging
from app.queue import celery_config, queue_name, reuse_broker_clients
from app.settings import Settings
from worker import runtime
from worker.kombu_fixes import survive_broker_loss
from worker.tasks import register_tasks

log = logging.getLogger("llmq.worker")


def create_celery(settings: Settings) -> Celery:
    survive_broker_loss()
    reuse_broker_clients()
    # Before the runtime creates its database engine (SQLAlchemy is instrumented then).
    tracing.setup(settings, service="llmq-worker")
    app = Celery("llmq-worker")
    app.conf.update(celery_config(settings))
    app.conf.update(
        worker_pool="threads",
        worker_concurrency=settings.inflight_limit,
        worker_prefetch_multiplier=1,
        task_queues=[Queue(queue_name(settings.model_name))],
        task_default_queue=queue_name(settings.model_name),
        worker_hijack_root_logger=False,
        worker_send_task_events=False,
        worker_enable_remote_control=True,
    )
    register_tasks(app)
    _connect_signals(app, settings)
    return app


def _connect_signals(app: Celery, settings: Settings) -> None:
    def on_init(sender: Any = None, **_: Any) -> None:
        # Runs in the main process before the consumer starts: no job is taken until the
        # engine can serve it.
        hostname = getattr(sender, "hostname", None)

        def consuming() -> bool:
            replies = app.control.ping(destination=[hostname], timeout=2.0) if hostname else []
            return bool(replies)

        engine, renderer = runtime.build_engine(settings)
        rt = runtime.WorkerRuntime(settings, engine, renderer, name=hostname, consuming=consuming)
        rt.start()
        runtime.set_current(rt)

    def on_ready(**_: Any) -> None:
        runtime.current().consumer_ready()
        # The engine is up and every library imported: what exists now lives as long as
        # the worker, and collections skip it from here on (app/heap.py).
        log.info("startup heap frozen", extra={"objects": freeze_startup_heap()})

    def on_shutting_down(**_: Any) -> None:
        rt = runtime.current()
        log.info("shutting down: draining", extra={"grace_seconds": settings.shutdown_grace_seconds})
        threading.Thread(
            target=rt.drain, args=(settings.shutdown_grace_seconds,), name="llmq-drain", daemon=True
        ).start()

    def on_shutdown(**_: Any) -> None:
        rt = runtime.current()
        rt.stop()
        runtime.set_current(None)
        log.info("worker stopped")

    def on_setup_logging(**_: Any) -> None:
        # A receiver here means Celery adds no handler of its own (its task logger's
        # included) and leaves stdout alone: its records reach llmq's root handler.
        configure_logging(settings)

    signals.setup_logging.connect(on_setup_logging, weak=False)
    signals.worker_init.connect(on_init, weak=False)
    signals.worker_ready.connect(on_ready, weak=False)
    signals.worker_shutting_down.connect(on_shutting_down, weak=False)
    signals.worker_shutdown.connect(on_shutdown, weak=False)
