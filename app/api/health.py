"""Liveness, readiness and Prometheus metrics; no auth, so orchestrators can probe."""

from __future__ import annotations

from flask import Blueprint, Response, jsonify

from app.api.deps import services

bp = Blueprint("health", __name__)


@bp.get("/healthz")
def healthz() -> Response:
    return jsonify({"status": "ok"})


@bp.get("/readyz")
def readyz() -> Response:
    result = services().health.readiness()
    response = jsonify({"status": "ready" if result.ready else "not_ready", "checks": result.checks})
    response.status_code = 200 if result.ready else 503
    return response


@bp.get("/metrics")
def metrics() -> Response:
    return Response(services().metrics.render(), mimetype="text/plain; version=0.0.4; charset=utf-8")
