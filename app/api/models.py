"""`GET /v1/models`: what this deployment serves."""

from __future__ import annotations

from flask import Blueprint, Response, jsonify

from app.api.deps import authenticate, services
from app.schemas.jobs import ModelCard, ModelList

bp = Blueprint("models", __name__)
bp.before_request(authenticate)

_STARTED = 0


@bp.get("/v1/models")
def list_models() -> Response:
    s = services()
    cards = [
        ModelCard(id=name, created=_STARTED, max_model_len=s.max_model_len)
        for name in sorted(s.served_models)
    ]
    return jsonify(ModelList(data=cards).model_dump())
