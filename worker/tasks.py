"""Celery tasks: a few lines each; the work is in worker/runner.py."""

from __future__ import annotations

import threading

from celery import Celery, Task

from app.queue import RUN_JOB_TASK, RUN_JOBS_TASK
from app.request_ids import MESSAGE_HEADER, bound, sane
from app.threads import name_native_thread
from worker import runtime

TASK_THREAD = "llmq-task"
_thread = threading.local()


def _name_task_thread() -> None:
    """Celery's pool threads, named once each by the first task they run (its thread pool
    takes no initializer)."""
    if not getattr(_thread, "named", False):
        _thread.named = True
        name_native_thread(TASK_THREAD)


def register_tasks(app: Celery) -> None:
    @app.task(name=RUN_JOB_TASK, bind=True, acks_late=True, reject_on_worker_lost=True, ignore_result=True)
    def run_job(self: Task, job_id: str) -> str | None:
        _name_task_thread()
        rt = runtime.current()
        # The message's request id is current while the task runs (for tracing, and for any
        # line logged outside the job's own); the job's lines carry the id stored on it.
        sent = self.request.get(MESSAGE_HEADER)
        try:
            with bound(sent if isinstance(sent, str) and sane(sent) else None):
                return rt.runner.run(job_id)
        finally:
            # Whatever happened, this message is spent: without its marker, a job left
            # queued is sent again by the sweeper (app/liveness.py, row 4).
            rt.liveness.spent(job_id)

    @app.task(name=RUN_JOBS_TASK, acks_late=True, reject_on_worker_lost=True, ignore_result=True)
    def run_jobs(job_ids: list[str]) -> int:
        """A chunk of batch lines, run together in the engine."""
        _name_task_thread()
        rt = runtime.current()
        try:
            statuses = rt.runner.run_many(job_ids, batch=True)
        finally:
            rt.liveness.spent(*job_ids)
            rt.wake_feeder()
        return sum(1 for s in statuses.values() if s is not None)
