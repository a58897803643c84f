"""What routes need from the request context: the services, the caller, the body."""

from __future__ import annotations

from typing import Any, cast

from flask import current_app, g, request

from app.container import Services
from app.services.idempotency import IdempotencyKey
from app.services.keys import Principal
from app.services.parsing import load_json


def services() -> Services:
    return cast(Services, current_app.extensions["llmq"])


def authenticate() -> None:
    """`before_request` hook for blueprints behind auth."""
    header = request.headers.get("Authorization", "")
    scheme, _, key = header.partition(" ")
    token = key.strip() if scheme.lower() == "bearer" else None
    g.principal = services().keys.authenticate(token)
    services().limiter.check(g.principal.key_id)


def principal() -> Principal:
    return cast(Principal, g.principal)


def idempotency(payload: Any) -> IdempotencyKey | None:
    return IdempotencyKey.from_header(request.headers.get("Idempotency-Key"), request.path, payload)


def json_body(*, job: bool = False) -> Any:
    """The parsed body. `job`: the body becomes a job's stored request, which the worker
    will not render past `max_request_bytes`, so it is refused here (413) instead."""
    settings = services().settings
    limit = min(settings.max_body_bytes, settings.max_request_bytes) if job else settings.max_body_bytes
    return load_json(request.get_data(cache=False), max_bytes=limit, max_depth=settings.max_json_depth)
