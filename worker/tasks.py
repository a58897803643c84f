"""Celery tasks: a few lines each; the work is in worker/runner.py."""

from __future__ import annotations

from celery import Celery

from app.queue import RUN_JOB_TASK
from worker import runtime


def register_tasks(app: Celery) -> None:
    @app.task(name=RUN_JOB_TASK, acks_late=True, reject_on_worker_lost=True, ignore_result=True)
    def run_job(job_id: str) -> str | None:
        rt = runtime.current()
        status = rt.runner.run(job_id)
        rt.queue.forget(job_id)
        return status
