"""`/v1/batches`: OpenAI Batches, plus `/retry` (an extension)."""

from __future__ import annotations

from flask import Blueprint, Response, jsonify, request, stream_with_context

from app.api.chat import sse_response, take_slot
from app.api.deps import authenticate, idempotency, json_body, principal, services
from app.api.files import _limit
from app.domain.metadata import metadata_filter
from app.errors import InvalidRequest

bp = Blueprint("batches", __name__)
bp.before_request(authenticate)


@bp.post("/v1/batches")
def create_batch() -> Response:
    payload = json_body()
    return jsonify(
        services().batches.create(principal(), payload, idem=idempotency(payload)).model_dump(mode="json")
    )


@bp.get("/v1/batches")
def list_batches() -> Response:
    page = services().batches.list(
        principal(),
        after=request.args.get("after"),
        limit=_limit(20),
        metadata=metadata_filter(request.args.items(multi=True)),
    )
    return jsonify(page.model_dump(mode="json"))


@bp.get("/v1/batches/<batch_id>")
def get_batch(batch_id: str) -> Response:
    return jsonify(services().batches.get(principal(), batch_id).model_dump(mode="json"))


@bp.post("/v1/batches/<batch_id>/cancel")
def cancel_batch(batch_id: str) -> Response:
    return jsonify(services().batches.cancel(principal(), batch_id).model_dump(mode="json"))


@bp.post("/v1/batches/<batch_id>/retry")
def retry_batch(batch_id: str) -> Response:
    return jsonify(services().batches.retry(principal(), batch_id).model_dump(mode="json"))


def _follow() -> bool:
    """`follow=true`, or else an `Accept` that prefers `text/event-stream` to JSONL."""
    raw = request.args.get("follow")
    if raw is None:
        return request.accept_mimetypes.best_match(["application/jsonl", "text/event-stream"]) == (
            "text/event-stream"
        )
    if raw.lower() in ("true", "1", "yes"):
        return True
    if raw.lower() in ("false", "0", "no"):
        return False
    raise InvalidRequest(f"`follow` must be true or false, got {raw!r}", param="follow")


@bp.get("/v1/batches/<batch_id>/results")
def batch_results(batch_id: str) -> Response:
    """Every line ended so far as JSONL (`after=` skips what the caller has; the cursor of
    the last line sent is in `X-Llmq-Cursor`), or followed as SSE until the batch ends."""
    s = services()
    follow = _follow()
    slot = take_slot()
    with s.slots.released_on_error(slot):
        if follow:
            cursor = (
                request.headers.get("Last-Event-ID")
                or request.args.get("last_event_id")
                or request.args.get("after")
            )
            return sse_response(s.results.follow(principal(), batch_id, cursor), None, slot)
        prefix = s.results.prefix(principal(), batch_id, request.args.get("after"))
    response = Response(stream_with_context(s.slots.attach(slot, prefix.lines)), mimetype="application/jsonl")
    response.headers["X-Llmq-Batch-Status"] = prefix.status
    if prefix.cursor is not None:
        response.headers["X-Llmq-Cursor"] = str(prefix.cursor)
    return response
