"""`/v1/batches`: OpenAI Batches, plus `/retry` (an extension)."""

from __future__ import annotations

from flask import Blueprint, Response, jsonify, request

from app.api.deps import authenticate, idempotency, json_body, principal, services
from app.api.files import _limit
from app.domain.metadata import metadata_filter

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
