"""Scale's LLM Engine v1 completions, for its unchanged `llmengine` client:
`POST /v1/llm/completions-sync?model_endpoint_name=M` and `-stream`."""

from __future__ import annotations

from flask import Blueprint, Response, jsonify, request

from app.api.chat import sse_response, take_slot
from app.api.deps import authenticate, json_body, principal, services

bp = Blueprint("scale", __name__)
bp.before_request(authenticate)


@bp.post("/v1/llm/completions-sync")
def completions_sync() -> Response | tuple[Response, int]:
    payload = json_body(job=True)
    result = services().scale.sync(principal(), request.args.get("model_endpoint_name"), payload)
    if result.pending is not None:
        return jsonify(result.pending.model_dump(mode="json")), 202
    response = jsonify(result.response)
    response.headers["X-Llmq-Job-Id"] = result.job_id
    return response


@bp.post("/v1/llm/completions-stream")
def completions_stream() -> Response:
    payload = json_body(job=True)
    # Taken before the job is queued, so a caller over the cap gets a 429 and no job.
    slot = take_slot()
    with services().slots.released_on_error(slot):
        result = services().scale.stream(principal(), request.args.get("model_endpoint_name"), payload)
    assert result.stream is not None
    return sse_response(result.stream, result.job_id, slot)
