"""`/v2/batch-completions`: llm-engine's v2 batch completions (app/services/scale_batches.py)."""

from __future__ import annotations

from flask import Blueprint, Response, jsonify

from app.api.deps import authenticate, json_body, principal, services

bp = Blueprint("scale_batches", __name__)
bp.before_request(authenticate)


@bp.post("/v2/batch-completions")
def create_batch_completions() -> Response:
    job = services().scale_batches.create(principal(), json_body())
    return jsonify(job.model_dump(mode="json", by_alias=True))


@bp.get("/v2/batch-completions/<job_id>")
def get_batch_completions(job_id: str) -> Response:
    return jsonify(services().scale_batches.get(principal(), job_id).model_dump(mode="json", by_alias=True))


@bp.post("/v2/batch-completions/<job_id>/actions/cancel")
def cancel_batch_completions(job_id: str) -> Response:
    return jsonify(services().scale_batches.cancel(principal(), job_id).model_dump(mode="json"))
