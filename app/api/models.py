"""`GET /v1/models`: what this deployment serves now (app/services/models.py)."""

from __future__ import annotations

from flask import Blueprint, Response, jsonify

from app.api.deps import authenticate, services
from app.schemas.jobs import ModelCard, ModelList

bp = Blueprint("models", __name__)
bp.before_request(authenticate)

_STARTED = 0


@bp.get("/v1/models")
def list_models() -> Response:
    models = services().models.all()
    cards = [
        ModelCard(
            id=m.name,
            created=_STARTED,
            max_model_len=m.max_model_len,
            live=m.live,
            workers=len(m.capacities),
            declared=m.declared,
        )
        for m in sorted(models.values(), key=lambda m: m.name)
    ]
    return jsonify(ModelList(data=cards).model_dump())
