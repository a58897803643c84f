"""Domain errors: one hierarchy, each with its HTTP status and OpenAI-style `type`.

Services raise these; the API renders every one of them the same way:
``{"error": {"message", "type", "param", "code"}}``. That shape, and the batch line's
``{"code", "message"}``, are built here and nowhere else.
"""

from __future__ import annotations

from typing import Any, ClassVar


def error_object(
    message: str, type: str, *, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """The inside of an error body (`ErrorBody`): what SSE error events and job rows carry."""
    return {"message": message, "type": type, "param": param, "code": code}


def error_body(
    message: str, type: str, *, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """The one error body (`ErrorResponse`): ``{"error": {message, type, param, code}}``."""
    return {"error": error_object(message, type, param=param, code=code)}


def line_error(code: str, message: str) -> dict[str, str]:
    """OpenAI's other error shape: a batch output line's `error` and a batch's `errors`
    entry (`BatchError`) carry only a code and a message."""
    return {"code": code, "message": message}


class LlmqError(Exception):
    status: ClassVar[int] = 500
    type: ClassVar[str] = "internal_error"
    default_code: ClassVar[str | None] = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code or self.default_code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, param=self.param, code=self.code)


class InvalidRequest(LlmqError):
    status = 400
    type = "invalid_request_error"


class Unsupported(InvalidRequest):
    """A field the contract knows but this deployment does not honour."""

    default_code = "unsupported_parameter"


class Unauthorized(LlmqError):
    status = 401
    type = "authentication_error"
    default_code = "invalid_api_key"


class Forbidden(LlmqError):
    status = 403
    type = "permission_error"
    default_code = "forbidden"


class NotFound(LlmqError):
    status = 404
    type = "not_found_error"
    default_code = "not_found"


class Conflict(LlmqError):
    status = 409
    type = "conflict_error"


class PayloadTooLarge(LlmqError):
    status = 413
    type = "invalid_request_error"
    default_code = "payload_too_large"


class Unprocessable(LlmqError):
    status = 422
    type = "invalid_request_error"


class RateLimited(LlmqError):
    status = 429
    type = "rate_limit_error"
    default_code = "rate_limit_exceeded"

    def __init__(
        self, message: str, *, retry_after: float, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message, param=param, code=code)
        self.retry_after = retry_after


class ServiceUnavailable(LlmqError):
    status = 503
    type = "service_unavailable_error"
    default_code = "service_unavailable"

    def __init__(
        self,
        message: str,
        *,
        retry_after: float | None = None,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message, param=param, code=code)
        self.retry_after = retry_after


class EngineError(LlmqError):
    """The engine failed a request; not the caller's fault."""

    status = 500
    type = "engine_error"
