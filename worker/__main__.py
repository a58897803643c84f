"""`python -m worker`: one worker process (one engine) consuming its model's queue."""

from __future__ import annotations

import os
import sys

from app.logs import configure_logging
from app.settings import Settings


def main(argv: list[str] | None = None) -> None:
    # One process serves this worker's metrics from its own registry (worker/metrics.py):
    # a multiprocess folder meant for the API must not divert them (vLLM would read it too).
    os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
    settings = Settings()
    configure_logging(settings)
    from worker.celery_app import create_celery

    app = create_celery(settings)
    args = [
        "worker",
        f"--hostname=llmq-{os.getpid()}@%h",
        f"--loglevel={settings.log_level}",
        "--without-gossip",
        "--without-mingle",
        *(argv if argv is not None else sys.argv[1:]),
    ]
    app.worker_main(args)


if __name__ == "__main__":
    main()
