"""How the API is served: gunicorn with gevent workers.

An SSE subscriber mostly waits; with gevent each one is a greenlet, not a thread blocked
for the life of the stream, so one worker holds thousands of idle streams. Postgres
(psycopg 3) and Redis (redis-py) both cooperate with gevent once it has patched the
standard library, which the gevent worker does before the app is imported.
"""

from __future__ import annotations

import sys

from app.settings import Settings

APP = "app.api:serve_app()"
# gunicorn's own lines in llmq's log format (JSON with LLMQ_LOG_JSON).
LOGGER_CLASS = "app.gunicorn_logging.Logger"
# On SIGTERM, how long open requests may finish (LLMQ_API_GRACEFUL_SECONDS's default).
GRACEFUL_SECONDS: int = Settings.model_fields["api_graceful_seconds"].default


def gunicorn_argv(
    host: str,
    port: int,
    *,
    workers: int = 2,
    connections: int = 2000,
    app: str = APP,
    graceful_seconds: int = GRACEFUL_SECONDS,
) -> list[str]:
    """`app`: the WSGI app to serve (the benchmarks serve a hello-world app the same way)."""
    return [
        sys.executable,
        "-m",
        "gunicorn",
        "--worker-class",
        "gevent",
        "--workers",
        str(workers),
        "--worker-connections",
        str(connections),
        "--bind",
        f"{host}:{port}",
        "--graceful-timeout",
        str(graceful_seconds),
        "--timeout",
        "120",
        "--log-level",
        "warning",
        "--logger-class",
        LOGGER_CLASS,
        # Hooks for the metrics each worker process records (app/gunicorn_conf.py).
        "--config",
        "python:app.gunicorn_conf",
        app,
    ]
