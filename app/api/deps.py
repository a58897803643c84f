"""What routes need from the request context: the services, the caller, the body."""

from __future__ import annotations

import base64
import binascii
import contextlib
from typing import Any, cast

from flask import current_app, g, request

from app.api.access import peer_address
from app.container import Services
from app.errors import RateLimited, Unauthorized
from app.request_ids import note_tenant
from app.services.idempotency import IdempotencyKey
from app.services.keys import Principal
from app.services.parsing import load_json


def services() -> Services:
    return cast(Services, current_app.extensions["llmq"])


def api_key() -> str | None:
    """The caller's key: `Authorization: Bearer <key>`, or HTTP Basic with the key as the
    user name (Scale's `llmengine` client sends `auth=(key, "")`; the password is ignored).
    None when neither scheme is sent.

    Raises:
        Unauthorized: a Basic header that is not base64 of `user:password` in UTF-8.
    """
    header = request.headers.get("Authorization", "")
    scheme, _, value = header.strip().partition(" ")
    scheme = scheme.lower()
    if scheme == "bearer":
        return value.strip()
    if scheme != "basic":
        return None
    try:
        decoded = base64.b64decode(value.strip(), validate=True).decode("utf-8")
    except (binascii.Error, ValueError) as exc:
        raise Unauthorized("malformed Basic credentials: expected base64 of '<key>:'") from exc
    user, colon, _ = decoded.partition(":")
    if not colon:
        raise Unauthorized("malformed Basic credentials: expected base64 of '<key>:'")
    return user


def optional_principal() -> Principal | None:
    """The caller when they sent a valid key, else None (never an error): for public routes
    that show more to an authenticated caller. A wrong key still counts as a failed
    authentication for its address."""
    s = services()
    try:
        token = api_key()
        if not token:
            return None
        found = s.keys.authenticate(token)
    except Unauthorized:
        with contextlib.suppress(RateLimited):  # a probe is never refused, only shown less
            s.auth_failures.check(client_address())
        return None
    note_tenant(found.tenant_id)
    return found


def client_address() -> str:
    """The caller's address as app/api/access.py's `peer_address` reads it."""
    return peer_address(request.environ, services().settings.trusted_proxy_hops)


def authenticate() -> None:
    """`before_request` hook for blueprints behind auth.

    Failed attempts (no, unknown or revoked key) are counted per client address; past the
    limit they are 429s. Only failures are counted: a correct key is never refused by the
    address limit (a valid tenant behind the same NAT or proxy as an attacker keeps
    working) and is limited by its own per-key rate alone. Keys are 256-bit random, so the
    limit is about load and noise, not guessing.
    """
    s = services()
    try:
        g.principal = s.keys.admit(api_key(), s.limiter)
    except Unauthorized:
        s.auth_failures.check(client_address())
        raise
    note_tenant(g.principal.tenant_id)


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
