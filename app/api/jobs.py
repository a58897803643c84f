"""`/v2/jobs`: submit, read, list, cancel; `/v2/throughput`: the tenant's jobs over time."""

from __future__ import annotations

from flask import Blueprint, Response, jsonify, request

from app.api.chat import sse_response, take_slot
from app.api.deps import authenticate, idempotency, json_body, principal, services
from app.domain.metadata import metadata_filter
from app.errors import InvalidRequest

bp = Blueprint("jobs", __name__)
bp.before_request(authenticate)


@bp.post("/v2/jobs")
def submit_job() -> tuple[Response, int]:
    payload = json_body(job=True)
    job = services().jobs.submit(principal(), payload, idem=idempotency(payload))
    return jsonify(job.model_dump(mode="json")), 202


@bp.get("/v2/jobs/<job_id>")
def get_job(job_id: str) -> Response:
    return jsonify(services().jobs.get(principal(), job_id).model_dump(mode="json"))


def _int_arg(name: str, default: int) -> int:
    raw = request.args.get(name, str(default))
    try:
        return int(raw)
    except ValueError as exc:
        raise InvalidRequest(f"`{name}` must be an integer, got {raw!r}", param=name) from exc


@bp.get("/v2/jobs")
def list_jobs() -> Response:
    limit = _int_arg("limit", 20)
    page = services().jobs.list(
        principal(),
        status=request.args.get("status"),
        batch_id=request.args.get("batch_id"),
        after=request.args.get("after"),
        limit=limit,
        metadata=metadata_filter(request.args.items(multi=True)),
    )
    return jsonify(page.model_dump(mode="json"))


@bp.get("/v2/jobs/<job_id>/request")
def job_request(job_id: str) -> Response:
    return jsonify(services().jobs.request_of(principal(), job_id).model_dump(mode="json"))


@bp.post("/v2/jobs/<job_id>/cancel")
def cancel_job(job_id: str) -> Response:
    return jsonify(services().jobs.cancel(principal(), job_id).model_dump(mode="json"))


@bp.get("/v2/jobs/<job_id>/stream")
def stream_job(job_id: str) -> Response:
    """SSE: the backlog, then live events; `Last-Event-ID` resumes after an event."""
    include = request.args.get("include_usage")
    slot = take_slot()
    with services().slots.released_on_error(slot):
        body = services().streams.open_stream(
            principal(),
            job_id,
            request.headers.get("Last-Event-ID") or request.args.get("last_event_id"),
            include_usage=None if include is None else include.lower() in ("1", "true", "yes"),
        )
    return sse_response(body, job_id, slot)


@bp.get("/v2/jobs/<job_id>/events")
def job_events(job_id: str) -> Response:
    """The recorded stream (seed 002's shape)."""
    return jsonify(services().streams.recorded(principal(), job_id))


@bp.get("/v2/throughput")
def throughput() -> Response:
    figures = services().throughput.read(
        principal(),
        window_seconds=_int_arg("window_seconds", 3600),
        bucket_seconds=_int_arg("bucket_seconds", 60),
    )
    return jsonify(figures.model_dump(mode="json"))
