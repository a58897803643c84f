"""`python -m worker`: one worker process (one engine) consuming its model's queue."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading

from app.logs import configure_logging
from app.settings import Settings
from worker.stdio import capture_output


def main(argv: list[str] | None = None) -> None:
    # One process serves this worker's metrics from its own registry (worker/metrics.py):
    # a multiprocess folder meant for the API must not divert them (vLLM would read it too).
    os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
    settings = Settings()
    if settings.log_json:
        # What bypasses logging (C++ warnings, progress bars, prints) becomes JSON too.
        capture_output()
    configure_logging(settings)
    from worker.celery_app import create_celery

    app = create_celery(settings)
    args = [
        # No banner: what it says (queue, concurrency) is in llmq's own start-up lines, and
        # it would be the one part of a JSON log that is not JSON.
        "--quiet",
        "worker",
        f"--hostname=llmq-{os.getpid()}@%h",
        f"--loglevel={settings.log_level}",
        "--without-gossip",
        "--without-mingle",
        *(argv if argv is not None else sys.argv[1:]),
    ]
    try:
        app.worker_main(args)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    else:
        code = 0
    leave(code)


def leave(code: int) -> None:
    """Exit once Celery has stopped (jobs drained or handed back, messages acknowledged,
    connections closed): threads are joined and exit handlers run (logs drained, spans
    flushed, temporary files removed) as at any exit; the interpreter's teardown does not.
    Freeing every module took 1.2 s on an idle worker and 3-4 s under load, past a
    platform's kill window (honcho's is 5 s after its SIGTERM), so a drained worker would
    be killed on its way out."""
    # As the interpreter's exit does first: wait for the threads that are not daemons (the
    # task pool's, whose last jobs are being handed back) and run threading's exit hooks.
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
