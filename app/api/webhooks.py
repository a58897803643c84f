"""`/v1/webhook_endpoints`: OpenAI's webhook endpoint API, plus `/deliveries` (an extension)."""

from __future__ import annotations

from flask import Blueprint, Response, jsonify, request

from app.api.deps import authenticate, json_body, principal, services
from app.api.files import _limit

bp = Blueprint("webhooks", __name__)
bp.before_request(authenticate)


@bp.post("/v1/webhook_endpoints")
def create_endpoint() -> Response:
    return jsonify(services().webhooks.create(principal(), json_body()).model_dump(mode="json"))


@bp.get("/v1/webhook_endpoints")
def list_endpoints() -> Response:
    page = services().webhooks.list(principal(), after=request.args.get("after"), limit=_limit(20))
    return jsonify(page.model_dump(mode="json"))


@bp.get("/v1/webhook_endpoints/<endpoint_id>")
def get_endpoint(endpoint_id: str) -> Response:
    return jsonify(services().webhooks.get(principal(), endpoint_id).model_dump(mode="json"))


@bp.post("/v1/webhook_endpoints/<endpoint_id>")
def update_endpoint(endpoint_id: str) -> Response:
    endpoint = services().webhooks.update(principal(), endpoint_id, json_body())
    return jsonify(endpoint.model_dump(mode="json"))


@bp.delete("/v1/webhook_endpoints/<endpoint_id>")
def delete_endpoint(endpoint_id: str) -> Response:
    return jsonify(services().webhooks.delete(principal(), endpoint_id).model_dump(mode="json"))


@bp.post("/v1/webhook_endpoints/<endpoint_id>/rotate_secret")
def rotate_secret(endpoint_id: str) -> Response:
    payload = json_body() if request.get_data(cache=True) else None
    endpoint = services().webhooks.rotate_secret(principal(), endpoint_id, payload)
    return jsonify(endpoint.model_dump(mode="json"))


@bp.get("/v1/webhook_endpoints/<endpoint_id>/deliveries")
def list_deliveries(endpoint_id: str) -> Response:
    page = services().webhooks.deliveries(
        principal(),
        endpoint_id,
        status=request.args.get("status"),
        after=request.args.get("after"),
        limit=_limit(20),
    )
    return jsonify(page.model_dump(mode="json"))
