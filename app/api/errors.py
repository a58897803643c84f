"""The one error handler: every failure leaves as `{"error": {...}}` with its status."""

from __future__ import annotations

import logging

from flask import Flask, Response, jsonify
from sqlalchemy.exc import TimeoutError as PoolTimeout
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

from app.errors import LlmqError, PayloadTooLarge, RateLimited, ServiceUnavailable, error_body

log = logging.getLogger("llmq.api")

_HTTP_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
}


def render(exc: LlmqError) -> Response:
    response = jsonify(exc.body())
    response.status_code = exc.status
    if isinstance(exc, RateLimited | ServiceUnavailable) and exc.retry_after is not None:
        response.headers["Retry-After"] = str(max(1, round(exc.retry_after)))
    if exc.status == 401:
        response.headers["WWW-Authenticate"] = 'Bearer realm="llmq"'
    return response


def register(app: Flask) -> None:
    @app.errorhandler(LlmqError)
    def _domain(exc: LlmqError) -> Response:
        return render(exc)

    @app.errorhandler(RequestEntityTooLarge)
    def _too_large(exc: RequestEntityTooLarge) -> Response:
        limit = app.config.get("MAX_CONTENT_LENGTH")
        return render(PayloadTooLarge(f"request body exceeds the limit of {limit} bytes"))

    @app.errorhandler(PoolTimeout)
    def _pool_exhausted(exc: PoolTimeout) -> Response:
        # Every pooled connection is busy: the client is not at fault and a retry soon
        # will likely succeed, so this is a 503 with Retry-After, never a 500.
        log.warning("database pool exhausted")
        return render(ServiceUnavailable("the service is busy; retry shortly", retry_after=2, code="busy"))

    @app.errorhandler(HTTPException)
    def _http(exc: HTTPException) -> Response:
        status = exc.code or 500
        body = error_body(
            exc.description or exc.name,
            _HTTP_TYPES.get(status, "api_error"),
            code=exc.name.lower().replace(" ", "_"),
        )
        response = jsonify(body)
        response.status_code = status
        return response

    @app.errorhandler(Exception)
    def _unexpected(exc: Exception) -> Response:
        log.exception("unhandled error")
        response = jsonify(error_body("internal error; the request was not completed", "internal_error"))
        response.status_code = 500
        return response
