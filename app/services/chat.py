"""The synchronous endpoints: queue a job, then wait for it (or relay its stream).

`/v1/chat/completions` and `/v2/chat/completions` return the completion; past the wait
limit they answer 202 with the job, which the client can poll. `/bench/chat/completions`
runs the same way with bench settings and returns the bench shape with the worker's stats.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from app.domain.status import JobKind, JobStatus
from app.errors import Conflict, EngineError, InvalidRequest, LlmqError
from app.schemas.jobs import JobObject
from app.services.idempotency import IdempotencyKey
from app.services.jobs import JobService
from app.services.keys import Principal
from app.services.streaming import StreamService


@dataclass
class ChatResult:
    """Exactly one of: a finished completion, a job still running, or an SSE body."""

    completion: dict[str, Any] | None = None
    pending: JobObject | None = None
    stream: Iterator[str] | None = None
    job_id: str | None = None


class _JobFailed(LlmqError):
    """A job's own error, re-raised with the status its type implies."""

    def __init__(self, error: dict[str, Any], status: int) -> None:
        super().__init__(
            error.get("message", "the job failed"), param=error.get("param"), code=error.get("code")
        )
        self.status = status  # type: ignore[misc]
        self.type = error.get("type", "api_error")  # type: ignore[misc]


class ChatService:
    def __init__(self, jobs: JobService, streams: StreamService, *, wait_seconds: float) -> None:
        self._jobs = jobs
        self._streams = streams
        self._wait = wait_seconds

    def complete(
        self, principal: Principal, payload: Any, *, bench: bool = False, idem: IdempotencyKey | None = None
    ) -> ChatResult:
        """Raises:
        InvalidRequest and friends: the request cannot run here (nothing is stored).
        LlmqError: the job itself failed; its error, with the status its type implies.
        """
        request = self._jobs.validate(payload, streaming=not bench)
        if request.stream_options is not None and not request.stream:
            # As OpenAI: options for a stream that was not asked for are a mistake, not a no-op.
            raise InvalidRequest(
                "`stream_options` is only allowed when `stream` is true", param="stream_options"
            )
        if bench and request.completion_limit() is None:
            raise InvalidRequest(
                "bench requests need `max_tokens`: they generate exactly that many", param="max_tokens"
            )
        kind = JobKind.BENCH if bench else JobKind.CHAT
        job = self._jobs.submit_request(principal, request, kind=kind, idem=idem)
        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            stream = self._streams.open_submitted(principal, job, kind, include_usage=include_usage)
            return ChatResult(stream=stream, job_id=job.id)
        if not self._streams.wait_for_end(principal, job.id, self._wait):
            return ChatResult(pending=self._jobs.get(principal, job.id), job_id=job.id)
        done = self._jobs.get(principal, job.id)
        return ChatResult(completion=finished_body(done, bench=bench), job_id=job.id)


def finished_body(job: JobObject, *, bench: bool = False) -> dict[str, Any]:
    """What a sync endpoint answers for an ended job: its response (with the worker's
    statistics for `bench`), or its error raised with the status its type implies.

    Raises:
        LlmqError: the job failed (its own error), was cancelled (409) or ended without a result.
    """
    if job.status == JobStatus.SUCCEEDED and job.response is not None:
        body = dict(job.response)
        if bench:
            body["generation_stats"] = job.generation_stats
            body["power_usage"] = job.power_usage
        return body
    if job.status == JobStatus.FAILED and job.error is not None:
        error = job.error.model_dump()
        status = 400 if error.get("type") == "invalid_request_error" else 500
        raise _JobFailed(error, status)
    if job.status == JobStatus.CANCELLED:
        raise Conflict(f"job {job.id} was cancelled before it finished", code="job_cancelled")
    raise EngineError(f"job {job.id} ended {job.status.value} without a result")
