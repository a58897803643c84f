"""`POST /v1/completions` (OpenAI's text completions, sync or SSE)."""

from __future__ import annotations

from flask import Blueprint, Response

from app.api.chat import reply, slot_if_streaming
from app.api.deps import authenticate, idempotency, json_body, principal, services

bp = Blueprint("completions", __name__)
bp.before_request(authenticate)


@bp.post("/v1/completions")
def completions() -> Response | tuple[Response, int]:
    payload = json_body(job=True)
    slot = slot_if_streaming(payload)
    with services().slots.released_on_error(slot):
        result = services().text_completions.complete(principal(), payload, idem=idempotency(payload))
    return reply(result, slot)
