"""gunicorn's hooks for the API (`--config python:app.gunicorn_conf`, app/serve.py): the
folder where each worker process records its metrics, prometheus_client's multiprocess mode
(app/metrics.py).

The master sets `PROMETHEUS_MULTIPROC_DIR` before it forks a worker; a worker imports
prometheus_client when it loads the app, after the fork, so every worker records into the
folder (the value class is chosen when prometheus_client is imported: this module imports
it only inside a hook, once the variable is set). An operator's folder is wiped at start,
since files left by an earlier run would be counted again; without one, a fresh temporary
folder is made and removed on exit. A dead worker's live gauges are dropped; its counters
and histograms stay, as totals this replica has served.

And the board on which the workers take turns accepting connections (app/accept_balance.py):
made by the master before its first fork, a slot reserved for each worker it forks and freed
when that worker exits."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

ENV = "PROMETHEUS_MULTIPROC_DIR"

_made: list[str] = []
_board: Any = None  # app.accept_balance.Board, in the master and every worker it forks


def on_starting(server: Any) -> None:
    global _board
    from app.accept_balance import Board

    _board = Board(max(64, 4 * int(server.cfg.workers)))
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


def pre_fork(server: Any, worker: Any) -> None:
    worker.llmq_slot = _board.reserve() if _board is not None else None


def post_fork(server: Any, worker: Any) -> None:
    """An API process never imports torch: it needs transformers' tokenizers only, and
    transformers imports torch whenever it is installed (beside vLLM, in `llmq up`'s venv,
    it always is; the API image has none). A bare process importing the app and loading a
    tokenizer took 3.7 s and 478 MB of resident memory with torch, 1.3 s and 140 MB without.
    And MKL's count of the cores, in torch's import, binds the importing thread to each core
    in turn: on the core where vLLM's CPU worker computes, that thread was not run again
    until the engine was idle (an API process that gunicorn started while a long job ran
    served nothing for 11 minutes, and could not be killed meanwhile). A module set to None
    in `sys.modules` cannot be imported; transformers then reads and applies tokenizers and
    chat templates without it, and would only say once per process that models are
    unavailable (an advisory warning, silenced)."""
    sys.modules.setdefault("torch", None)  # type: ignore[arg-type]
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


def post_worker_init(worker: Any) -> None:
    """The worker takes its turns at accepting (before it starts serving), and it has loaded
    the app: its objects live as long as the process, and collections skip them from here on
    (app/heap.py)."""
    from app.accept_balance import Gate, install
    from app.heap import freeze_startup_heap

    slot = getattr(worker, "llmq_slot", None)
    if _board is not None and slot is not None:
        _board.take(slot, os.getpid())
        gate = Gate(_board, slot)
        worker.handle = gate.counted(worker.handle)
        install(gate)
    freeze_startup_heap()


def child_exit(server: Any, worker: Any) -> None:
    from prometheus_client import multiprocess

    slot = getattr(worker, "llmq_slot", None)
    if _board is not None and slot is not None:
        _board.free(slot)
    multiprocess.mark_process_dead(worker.pid)  # type: ignore[no-untyped-call]


def on_exit(server: Any) -> None:
    for path in _made:
        shutil.rmtree(path, ignore_errors=True)
