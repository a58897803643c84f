"""`ChatCompletionV2Request` → `GenerationSpec`: prompt token ids and the keyword arguments
of the installed vLLM's `SamplingParams` (names checked against vLLM 0.32's signature by
tests/integration/test_translate_vllm.py)."""

from __future__ import annotations

from typing import Any, Protocol

from app.errors import InvalidRequest
from app.models import JobKind
from app.schemas.chat import ChatCompletionV2Request
from worker.engine import GenerationSpec


class Renderer(Protocol):
    def render(self, req: ChatCompletionV2Request) -> list[int]: ...


def sampling_kwargs(req: ChatCompletionV2Request, *, max_tokens: int, bench: bool) -> dict[str, Any]:
    """The `SamplingParams` fields this request sets. Unset fields keep vLLM's defaults,
    except `temperature`, whose OpenAI default (1.0) is also vLLM's."""
    kw: dict[str, Any] = {"n": req.n or 1, "max_tokens": max_tokens}
    if req.temperature is not None:
        kw["temperature"] = req.temperature
    if req.top_p is not None:
        kw["top_p"] = req.top_p
    if req.top_k is not None:
        # OpenAI-style -1 ("all tokens") is vLLM's 0 in recent versions.
        kw["top_k"] = 0 if req.top_k == -1 else req.top_k
    if req.min_p is not None:
        kw["min_p"] = req.min_p
    if req.seed is not None:
        kw["seed"] = req.seed
    if req.stop is not None:
        kw["stop"] = [req.stop] if isinstance(req.stop, str) else list(req.stop)
    if req.ignore_eos or bench:
        kw["ignore_eos"] = True
    if bench:
        # Bench runs generate exactly max_tokens tokens.
        kw["min_tokens"] = max_tokens
    return kw


def translate(
    request: dict[str, Any],
    *,
    request_id: str,
    kind: str,
    renderer: Renderer,
    max_model_len: int,
) -> tuple[ChatCompletionV2Request, GenerationSpec]:
    """Raises:
    InvalidRequest: the prompt does not fit the model's context (a 400 for this job only).
    """
    req = ChatCompletionV2Request.model_validate(request)
    prompt = renderer.render(req)
    room = max_model_len - len(prompt)
    if room < 1:
        raise InvalidRequest(
            f"This model's maximum context length is {max_model_len} tokens; the messages "
            f"take {len(prompt)} tokens, leaving no room for the completion",
            param="messages",
            code="context_length_exceeded",
        )
    asked = req.completion_limit()
    if asked is not None and asked > room:
        field = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
        raise InvalidRequest(
            f"This model's maximum context length is {max_model_len} tokens; the messages "
            f"take {len(prompt)} and `{field}` asks for {asked} more",
            param=field,
            code="context_length_exceeded",
        )
    max_tokens = asked if asked is not None else room
    spec = GenerationSpec(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling=sampling_kwargs(req, max_tokens=max_tokens, bench=kind == JobKind.BENCH.value),
        priority=req.effective_priority(),
    )
    return req, spec
