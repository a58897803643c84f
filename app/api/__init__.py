"""The Flask API: `create_app(settings)` assembles blueprints; routes stay thin."""

from __future__ import annotations

from flask import Flask, request

from app.container import Services, build_services
from app.errors import InvalidRequest
from app.settings import Settings


def create_app(settings: Settings | None = None, *, services: Services | None = None) -> Flask:
    """Build the WSGI app. Importing this package connects to nothing."""
    from app.api import batches, chat, errors, files, health, jobs, models, openapi
    from app.logs import configure_logging

    settings = settings or (services.settings if services else Settings())
    configure_logging(settings)
    app = Flask("llmq")
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    app.extensions["llmq"] = services or build_services(settings)

    errors.register(app)
    app.before_request(_refuse_nul)
    for blueprint in (health.bp, jobs.bp, chat.bp, files.bp, batches.bp, models.bp, openapi.bp):
        app.register_blueprint(blueprint)
    return app


def _refuse_nul() -> None:
    """Ids, cursors and filters are Postgres text, which cannot hold U+0000 (bodies can:
    requests and results are stored as json)."""
    if "\x00" in request.path:
        raise InvalidRequest("the path holds a NUL character", param="path")
    for name, value in request.args.items(multi=True):
        if "\x00" in name or "\x00" in value:
            raise InvalidRequest(f"query parameter {name!r} holds a NUL character", param=name)
