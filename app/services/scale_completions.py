"""Scale's LLM Engine v1 completions (`/v1/llm/completions-sync`, `-stream`) on llmq's text
completions: the request becomes a `CompletionRequest` and runs as a `completion` job (the
same queue, job record and statistics as `/v1/completions`), and the job's answer is
reshaped into the client's `CompletionSyncV1Response` or its stream events.

The stream is relayed from the job's own SSE stream (which sends the usage last), one
event per token when token log probabilities were asked for, else one per chunk; the
last output event carries `finished: true` and both token counts. It ends without a
`data: [DONE]` line, which the client would try to parse as JSON.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from app.domain.status import JobKind
from app.errors import InvalidRequest, LlmqError
from app.schemas.jobs import JobObject
from app.schemas.scale import (
    CompletionOutput,
    CompletionStreamOutput,
    CompletionStreamV1Response,
    CompletionSyncV1Request,
    CompletionSyncV1Response,
    StreamError,
    StreamErrorContent,
    TokenOutput,
)
from app.schemas.text_completion import CompletionRequest
from app.services.keys import Principal
from app.services.parsing import parse_model
from app.services.sse import frame_data, frames_of
from app.services.streaming import StreamService
from app.services.text_completions import TextCompletionService

# CompletionRequest's fields under the names Scale's request uses, for errors that name them.
SCALE_NAMES = {
    "max_tokens": "max_new_tokens",
    "stop": "stop_sequences",
    "logprobs": "return_token_log_probs",
    "model": "model_endpoint_name",
    "prompt": "prompt",
}


def to_completion_request(model: str, req: CompletionSyncV1Request) -> CompletionRequest:
    """The OpenAI text completion this Scale request asks for (null fields left unset)."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": req.prompt,
        "max_tokens": req.max_new_tokens,
        "temperature": req.temperature,
    }
    if req.stop_sequences is not None:
        body["stop"] = req.stop_sequences
    if req.return_token_log_probs:
        body["logprobs"] = 0  # the sampled token's own log probability
    for name in (
        "presence_penalty",
        "frequency_penalty",
        "top_k",
        "top_p",
        "include_stop_str_in_output",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "skip_special_tokens",
    ):
        value = getattr(req, name)
        if value is not None:
            body[name] = value
    return CompletionRequest.model_validate(body)


def _renamed(exc: LlmqError) -> LlmqError:
    """The error with the field named as the Scale request names it."""
    param = exc.param
    if param is None or param.split(".")[0] not in SCALE_NAMES:
        return exc
    head, _, rest = param.partition(".")
    scale = SCALE_NAMES[head]
    exc.param = scale + (f".{rest}" if rest else "")
    exc.message = exc.message.replace(f"`{head}`", f"`{scale}`")
    return exc


def sync_response(job_id: str, completion: dict[str, Any]) -> dict[str, Any]:
    """`CompletionSyncV1Response` from the job's `text_completion`."""
    choice = completion["choices"][0]
    usage = completion.get("usage") or {}
    logprobs = choice.get("logprobs")
    tokens = (
        [
            TokenOutput(token=t, log_prob=p)
            for t, p in zip(logprobs["tokens"], logprobs["token_logprobs"], strict=True)
        ]
        if logprobs
        else None
    )
    output = CompletionOutput(
        text=choice["text"],
        num_prompt_tokens=usage.get("prompt_tokens"),
        num_completion_tokens=int(usage.get("completion_tokens") or 0),
        tokens=tokens,
    )
    return CompletionSyncV1Response(request_id=job_id, output=output).model_dump(mode="json")


@dataclass
class ScaleResult:
    """Exactly one of: the response, the job still running (past the wait), an SSE body."""

    job_id: str
    response: dict[str, Any] | None = None
    pending: JobObject | None = None
    stream: Iterator[str] | None = None


class ScaleCompletionService:
    def __init__(self, completions: TextCompletionService, streams: StreamService) -> None:
        self._completions = completions
        self._streams = streams

    def _submit(
        self, principal: Principal, model: str | None, payload: Any, *, streaming: bool
    ) -> tuple[JobObject, bool]:
        if not model:
            raise InvalidRequest(
                "the query parameter `model_endpoint_name` is required", param="model_endpoint_name"
            )
        scale = parse_model(CompletionSyncV1Request, payload)
        try:
            request = to_completion_request(model, scale)
            self._completions.policy.check(request, streaming=streaming)
        except ValidationError as exc:  # a bound CompletionRequest has that Scale's does not
            raise InvalidRequest(str(exc.errors(include_url=False)[0].get("msg"))) from exc
        except LlmqError as exc:
            raise _renamed(exc) from exc
        job = self._completions.submit(principal, request)
        return job, bool(scale.return_token_log_probs)

    def sync(self, principal: Principal, model: str | None, payload: Any) -> ScaleResult:
        """`POST /v1/llm/completions-sync`.

        Raises:
            InvalidRequest and friends: the request cannot run here (nothing is stored),
                naming the Scale field.
            LlmqError: the job itself failed; its error, with the status its type implies.
        """
        job, _ = self._submit(principal, model, payload, streaming=False)
        result = self._completions.wait(principal, job.id)
        if result.pending is not None:
            return ScaleResult(job.id, pending=result.pending)
        assert result.completion is not None
        return ScaleResult(job.id, response=sync_response(job.id, result.completion))

    def stream(self, principal: Principal, model: str | None, payload: Any) -> ScaleResult:
        """`POST /v1/llm/completions-stream`: validate and queue now, then relay."""
        job, logprobs = self._submit(principal, model, payload, streaming=True)
        frames = self._streams.open_submitted(principal, job, JobKind.COMPLETION, include_usage=True)
        return ScaleResult(job.id, stream=relay(job.id, frames, logprobs=logprobs))


def _event(job_id: str, output: CompletionStreamOutput) -> str:
    body = CompletionStreamV1Response(request_id=job_id, output=output)
    return f"data: {body.model_dump_json(exclude_none=False)}\n\n"


def _error_event(job_id: str, error: dict[str, Any]) -> str:
    status = {"invalid_request_error": 400, "cancelled": 409, "expired": 408}.get(str(error.get("type")), 500)
    content = StreamErrorContent(error=str(error.get("message")), timestamp=datetime.now(UTC).isoformat())
    body = CompletionStreamV1Response(
        request_id=job_id, error=StreamError(status_code=status, content=content)
    )
    return f"data: {body.model_dump_json()}\n\n"


def _outputs(choice: dict[str, Any], counted: int, logprobs: bool) -> list[CompletionStreamOutput]:
    """One chunk's choice as Scale events: one per token when its log probabilities were
    asked for and the tokens spell the text, else one for the whole chunk."""
    text = str(choice.get("text") or "")
    lp = choice.get("logprobs")
    if logprobs and lp and "".join(lp["tokens"]) == text:
        return [
            CompletionStreamOutput(
                text=token,
                finished=False,
                num_completion_tokens=counted + i + 1,
                token=TokenOutput(token=token, log_prob=p),
            )
            for i, (token, p) in enumerate(zip(lp["tokens"], lp["token_logprobs"], strict=True))
        ]
    tokens = len(lp["tokens"]) if lp else 0
    single = lp is not None and tokens == 1
    return [
        CompletionStreamOutput(
            text=text,
            finished=False,
            num_completion_tokens=counted + tokens if lp else None,
            token=TokenOutput(token=lp["tokens"][0], log_prob=lp["token_logprobs"][0])
            if single and lp
            else None,
        )
    ]


def relay(job_id: str, frames: Iterator[str], *, logprobs: bool) -> Iterator[str]:
    """The job's `text_completion` SSE stream as Scale's stream events. One output event is
    held back, so the last one can carry `finished` and the usage that follows it."""
    held: CompletionStreamOutput | None = None
    counted = 0
    for frame in (one for piece in frames for one in frames_of(piece)):
        data = frame_data(frame)
        if data is None:
            yield frame  # a heartbeat: a comment line, which the client skips
            continue
        if data == "[DONE]":
            break
        body = json.loads(data)
        if "error" in body:
            if held is not None:
                yield _event(job_id, held)
            yield _error_event(job_id, body["error"])
            return
        if not body.get("choices") and body.get("usage"):
            usage = body["usage"]
            last = held or CompletionStreamOutput(text="", finished=True)
            last.finished = True
            last.num_prompt_tokens = int(usage["prompt_tokens"])
            last.num_completion_tokens = int(usage["completion_tokens"])
            yield _event(job_id, last)
            held = None
            continue
        for choice in body.get("choices") or []:
            for output in _outputs(choice, counted, logprobs):
                if output.num_completion_tokens is not None:
                    counted = output.num_completion_tokens
                if held is not None:
                    yield _event(job_id, held)
                held = output
    if held is not None:
        yield _event(job_id, held)
