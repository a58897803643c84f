"""`POST /v1/completions`: a text completion queued as a job of kind `completion`, then
waited for (or its stream relayed), exactly as the chat endpoints do with theirs.

`validate` and `submit` are the pieces other front doors reuse (Scale's v1 completions,
batch lines): one request model (`CompletionRequest`), one policy, one job kind.
"""

from __future__ import annotations

from typing import Any

from app.domain.status import JobKind
from app.schemas.jobs import JobObject
from app.schemas.text_completion import CompletionRequest
from app.services.chat import ChatResult, finished_body
from app.services.completion_contract import CompletionPolicy
from app.services.idempotency import IdempotencyKey
from app.services.jobs import JobService
from app.services.keys import Principal
from app.services.parsing import parse_model
from app.services.streaming import StreamService


class TextCompletionService:
    def __init__(
        self, jobs: JobService, streams: StreamService, policy: CompletionPolicy, *, wait_seconds: float
    ) -> None:
        self._jobs = jobs
        self._streams = streams
        self._policy = policy
        self._wait = wait_seconds

    @property
    def policy(self) -> CompletionPolicy:
        return self._policy

    def validate(self, payload: Any, *, streaming: bool = True) -> CompletionRequest:
        """Raises:
        InvalidRequest / Unsupported / NotFound: the request cannot run here (nothing is stored).
        """
        request = parse_model(CompletionRequest, payload)
        self._policy.check(request, streaming=streaming)
        return request

    def submit(
        self, principal: Principal, request: CompletionRequest, *, idem: IdempotencyKey | None = None
    ) -> JobObject:
        """Store and enqueue a validated request as a `completion` job (see
        JobService.submit_request for what it raises)."""
        return self._jobs.submit_request(principal, request, kind=JobKind.COMPLETION, idem=idem)

    def complete(
        self, principal: Principal, payload: Any, *, idem: IdempotencyKey | None = None
    ) -> ChatResult:
        """Queue, then wait for the end (or relay the stream).

        Raises:
            InvalidRequest and friends: the request cannot run here (nothing is stored).
            LlmqError: the job itself failed; its error, with the status its type implies.
        """
        request = self.validate(payload)
        job = self.submit(principal, request, idem=idem)
        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            stream = self._streams.open_submitted(
                principal, job, JobKind.COMPLETION, include_usage=include_usage
            )
            return ChatResult(stream=stream, job_id=job.id)
        return self.wait(principal, job.id)

    def wait(self, principal: Principal, job_id: str) -> ChatResult:
        """The ended job's completion, or the job itself when the wait limit passed first."""
        if not self._streams.wait_for_end(principal, job_id, self._wait):
            return ChatResult(pending=self._jobs.get(principal, job_id), job_id=job_id)
        return ChatResult(completion=finished_body(self._jobs.get(principal, job_id)), job_id=job_id)
