"""The Flask API: `create_app(settings)` assembles blueprints; routes stay thin."""

from __future__ import annotations

import threading

from flask import Flask, request

from app.container import Services, build_services
from app.errors import InvalidRequest
from app.heap import refreeze_heap
from app.metrics import ROUTE_KEY
from app.settings import Settings


def create_app(settings: Settings | None = None, *, services: Services | None = None) -> Flask:
    """Build the WSGI app from `settings` (services are built from them) or from ready
    `services` (their own settings apply), never both: settings passed beside services
    would be silently ignored by everything the services already hold. Importing this
    package connects to nothing.

    Raises:
        TypeError: both `settings` and `services` were given.
    """
    from app import tracing
    from app.api import (
        batches,
        chat,
        completions,
        console,
        errors,
        files,
        health,
        jobs,
        models,
        openapi,
        scale,
        scale_batches,
        webhooks,
    )
    from app.api.access import AccessLog
    from app.logs import configure_logging

    if settings is not None and services is not None:
        raise TypeError("create_app takes settings or services, not both: services carry their own settings")
    settings = services.settings if services is not None else settings or Settings()
    configure_logging(settings)
    # Before the services: SQLAlchemy is instrumented when their engine is created.
    tracing.setup(settings, service="llmq-api")
    app = Flask("llmq")
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    app.extensions["llmq"] = services or build_services(settings)

    errors.register(app)
    app.before_request(_note_route)  # first: a request refused by a later hook still has its route
    app.before_request(_refuse_nul)
    for blueprint in (
        health.bp,
        jobs.bp,
        chat.bp,
        completions.bp,
        scale.bp,
        files.bp,
        batches.bp,
        scale_batches.bp,
        models.bp,
        webhooks.bp,
        openapi.bp,
        console.bp,
    ):
        app.register_blueprint(blueprint)
    tracing.instrument_app(app)
    # Outermost: every response gets its X-Request-ID and an access log line.
    app.wsgi_app = AccessLog(  # type: ignore[method-assign]
        app.wsgi_app,
        trusted_proxy_hops=settings.trusted_proxy_hops,
        observe=app.extensions["llmq"].api_metrics.observe_request,
    )
    return app


def serve_app(settings: Settings | None = None) -> Flask:
    """The app as gunicorn serves it (app/serve.py): `create_app`, and this process's
    Postgres connections opened and tokenizers warmed, in the background."""
    app = create_app(settings)
    services: Services = app.extensions["llmq"]
    # In each gunicorn worker (the app is loaded after the fork): no connection is shared.
    services.db.open_pool_in_background()
    warm_tokenizers(services)
    return app


def warm_tokenizers(services: Services) -> None:
    """Load the tokenizers of the models this API knows now (declared, or served by live
    workers; the registry keeps its last view when Redis is away) on a thread of its own (a
    greenlet under gevent): a process's first requests then find them loaded instead of
    waiting seconds for the load (app/services/tokenizers.py). Each load, now or later, is
    followed by a freeze of the heap (app/heap.py)."""
    counters = services.tokenizers
    if counters is None:
        return
    # A load brings transformers along: frozen, so collections skip it.
    counters.after_load = refreeze_heap
    threading.Thread(
        target=lambda: counters.warm(services.models.all().values()),
        name="llmq-tokenizers-warm",
        daemon=True,
    ).start()


def _note_route() -> None:
    """The matched URL rule, for the request metrics' `route` label (app/metrics.py)."""
    if request.url_rule is not None:
        request.environ[ROUTE_KEY] = request.url_rule.rule


def _refuse_nul() -> None:
    """Ids, cursors and filters are Postgres text, which cannot hold U+0000 (bodies can:
    requests and results are stored as json)."""
    if "\x00" in request.path:
        raise InvalidRequest("the path holds a NUL character", param="path")
    for name, value in request.args.items(multi=True):
        if "\x00" in name or "\x00" in value:
            raise InvalidRequest(f"query parameter {name!r} holds a NUL character", param=name)
