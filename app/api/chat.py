"""`POST /v1/chat/completions`, `/v2/chat/completions` (OpenAI-compatible, sync or SSE) and
`/bench/chat/completions` (bench shape)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from flask import Blueprint, Response, jsonify, stream_with_context

from app.api.deps import authenticate, idempotency, json_body, principal, services
from app.services.chat import ChatResult

bp = Blueprint("chat", __name__)
bp.before_request(authenticate)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def take_slot() -> str | None:
    """A slot of the caller's cap on open streams and downloads (429 over it)."""
    return services().slots.acquire(principal().key_id)


def sse_response(body: Iterator[str], job_id: str | None = None, slot: str | None = None) -> Response:
    body = services().slots.attach(slot, body)
    response = Response(stream_with_context(body), mimetype="text/event-stream", headers=SSE_HEADERS)
    if job_id:
        response.headers["X-Llmq-Job-Id"] = job_id
    return response


def reply(result: ChatResult, slot: str | None) -> Response | tuple[Response, int]:
    if result.stream is not None:
        return sse_response(result.stream, result.job_id, slot)
    services().slots.release(slot)
    if result.pending is not None:
        return jsonify(result.pending.model_dump(mode="json")), 202
    response = jsonify(result.completion)
    if result.job_id:
        response.headers["X-Llmq-Job-Id"] = result.job_id
    return response


@bp.post("/v1/chat/completions")
@bp.post("/v2/chat/completions")
def chat_completions() -> Response | tuple[Response, int]:
    payload = json_body(job=True)
    slot = slot_if_streaming(payload)
    with services().slots.released_on_error(slot):
        result = services().chat.complete(principal(), payload, idem=idempotency(payload))
    return reply(result, slot)


@bp.post("/bench/chat/completions")
def bench_chat_completions() -> Response | tuple[Response, int]:
    payload = json_body(job=True)
    slot = slot_if_streaming(payload)
    with services().slots.released_on_error(slot):
        result = services().chat.complete(principal(), payload, bench=True, idem=idempotency(payload))
    return reply(result, slot)


def slot_if_streaming(payload: Any) -> str | None:
    # Taken before the job is queued, so a caller over the cap gets a 429 and no job.
    streaming = isinstance(payload, dict) and payload.get("stream") is True
    return take_slot() if streaming else None
