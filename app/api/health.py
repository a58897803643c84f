"""Liveness, readiness and Prometheus metrics; no auth, so orchestrators can probe.

Worker names (host names and pids) are details: shown to everyone, to callers with a valid
key, or to no one, by `LLMQ_HEALTH_DETAILS`; readiness and per-model counts always show."""

from __future__ import annotations

from flask import Blueprint, Response, jsonify

from app.api.deps import optional_principal, services
from app.metrics import CONTENT_TYPE, Computed, build_info

bp = Blueprint("health", __name__)


@bp.get("/healthz")
def healthz() -> Response:
    return jsonify({"status": "ok"})


def _details() -> bool:
    mode = services().settings.health_details
    return mode == "public" or (mode == "authenticated" and optional_principal() is not None)


@bp.get("/readyz")
def readyz() -> Response:
    result = services().health.readiness(details=_details())
    response = jsonify({"status": "ready" if result.ready else "not_ready", "checks": result.checks})
    response.status_code = 200 if result.ready else 503
    return response


@bp.get("/metrics")
def metrics() -> Response:
    """This replica's processes' figures, its build info, and the cluster figures when this
    replica is the one that reports them (app/services/metrics.py)."""
    s = services()
    details = _details()
    text = s.api_metrics.exposition(
        Computed(lambda: [build_info("api")]), Computed(lambda: s.metrics.collect(details=details))
    )
    return Response(text, content_type=CONTENT_TYPE)
