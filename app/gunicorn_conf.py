"""gunicorn's hooks for the API (`--config python:app.gunicorn_conf`, app/serve.py): the
folder where each worker process records its metrics, prometheus_client's multiprocess mode
(app/metrics.py).

The master sets `PROMETHEUS_MULTIPROC_DIR` before it forks a worker; a worker imports
prometheus_client when it loads the app, after the fork, so every worker records into the
folder (the value class is chosen when prometheus_client is imported: this module imports
it only inside a hook, once the variable is set). An operator's folder is wiped at start,
since files left by an earlier run would be counted again; without one, a fresh temporary
folder is made and removed on exit. A dead worker's live gauges are dropped; its counters
and histograms stay, as totals this replica has served."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

ENV = "PROMETHEUS_MULTIPROC_DIR"

_made: list[str] = []


def on_starting(server: Any) -> None:
    path = os.environ.get(ENV)
    if not path:
        path = tempfile.mkdtemp(prefix="llmq-metrics-")
        _made.append(path)
        os.environ[ENV] = path
        return
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("*.db"):
        stale.unlink(missing_ok=True)


def post_worker_init(worker: Any) -> None:
    """The worker has loaded the app: its objects live as long as the process, and
    collections skip them from here on (app/heap.py)."""
    from app.heap import freeze_startup_heap

    freeze_startup_heap()


def child_exit(server: Any, worker: Any) -> None:
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(worker.pid)  # type: ignore[no-untyped-call]


def on_exit(server: Any) -> None:
    for path in _made:
        shutil.rmtree(path, ignore_errors=True)
