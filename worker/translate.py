"""`ChatCompletionV2Request` → what the engine runs: prompt token ids and the keyword
arguments of the installed vLLM's `SamplingParams` (names checked against vLLM 0.32's
signature by tests/integration/test_contract.py), plus what shaping the answer needs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from app.domain.budget import completion_budget
from app.domain.prompts import message_text
from app.domain.status import JobKind
from app.domain.structured import Constraint, constraint_of
from app.domain.tools import ToolPlan, plan_tools
from app.schemas.chat import AssistantMessage, ChatCompletionV2Request
from app.schemas.text_completion import CompletionRequest
from app.services.priority import clamp
from worker.engine import GenerationSpec


class Renderer(Protocol):
    def render(self, req: ChatCompletionV2Request, plan: ToolPlan | None = None) -> list[int]: ...

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


@dataclass(frozen=True)
class Translation:
    request: ChatCompletionV2Request | CompletionRequest
    spec: GenerationSpec
    tools: ToolPlan
    echo: str  # text the answer starts with (`echo` of a final assistant message)
    top_logprobs: int | None  # alternatives per token when logprobs were asked for
    constraint: Constraint | None = None  # the structured-output constraint, if any
    text: bool = False  # a text completion (`text_completion` objects, no chat template)

    @property
    def logprobs(self) -> bool:
        return self.top_logprobs is not None


# Request fields passed to SamplingParams under the same name when set.
_SAME_NAME = (
    "temperature",
    "top_p",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "stop_token_ids",
    "include_stop_str_in_output",
    "min_tokens",
    "skip_special_tokens",
    "spaces_between_special_tokens",
)


def sampling_kwargs(
    req: ChatCompletionV2Request | CompletionRequest,
    *,
    max_tokens: int,
    bench: bool,
    structured: dict[str, Any] | None,
    quiet_interval: int = 1,
) -> dict[str, Any]:
    """The `SamplingParams` fields this request sets; unset fields keep vLLM's defaults
    (the OpenAI defaults: temperature 1, top_p 1, no penalties).

    `quiet_interval`: tokens per engine update for a request not submitted with `stream:
    true` (vLLM's `stream_interval`; its first and last update come at once). Nobody may be
    reading such a job's tokens as they come (a batch line, a synchronous answer, a job that
    is polled), and vLLM's output objects for every step were the largest part of the
    worker's CPU for a job (B1's engine loop, 64 jobs of 256 tokens: 10.0-10.2 ms a job at
    every token, 7.7-8.3 at 16). A client that streams it after all lowers it then
    (`Engine.hasten`)."""
    kw: dict[str, Any] = {"n": req.n or 1, "max_tokens": max_tokens}
    if quiet_interval > 1 and not req.stream:
        kw["stream_interval"] = quiet_interval
    for name in _SAME_NAME:
        value = getattr(req, name)
        if value is not None:
            kw[name] = value
    if req.top_k is not None:
        # OpenAI-style -1 ("all tokens") is vLLM's 0 in recent versions.
        kw["top_k"] = 0 if req.top_k == -1 else req.top_k
    if req.stop is not None:
        kw["stop"] = [req.stop] if isinstance(req.stop, str) else list(req.stop)
    if req.ignore_eos or bench:
        kw["ignore_eos"] = True
    if bench:
        # Bench runs generate exactly max_tokens tokens.
        kw["min_tokens"] = max_tokens
    if req.logit_bias:
        kw["logit_bias"] = {int(token): float(bias) for token, bias in req.logit_bias.items()}
    if isinstance(req, CompletionRequest):
        if req.logprobs is not None:
            # A text completion's `logprobs` is the number of alternatives per token;
            # with `echo`, the prompt's tokens get theirs too (as vLLM's server does).
            kw["logprobs"] = req.logprobs
            if req.echo:
                kw["prompt_logprobs"] = req.logprobs
    elif req.logprobs:
        # The sampled token's logprob always comes back; `top_logprobs` adds alternatives.
        kw["logprobs"] = req.top_logprobs or 0
    if structured is not None:
        kw["structured_outputs"] = structured
    return kw


def echo_prefix(req: ChatCompletionV2Request) -> str:
    """With `echo`, an answer continuing the last assistant message starts with its text."""
    last = req.messages[-1]
    if req.echo and isinstance(last, AssistantMessage):
        return message_text(last.content) or ""
    return ""


def translate(
    request: dict[str, Any],
    *,
    request_id: str,
    kind: str,
    renderer: Renderer,
    max_model_len: int,
    tool_parser: str | None = None,
    priority: int | None = None,
    quiet_interval: int = 1,
) -> Translation:
    """`priority` is the job row's (resolved within the tenant's band when it was accepted);
    it wins over the request's own, which a batch line may leave unset.

    Raises:
    InvalidRequest: the prompt does not fit the model's context, or the template refused
    the messages (a 400 for this job only).
    """
    if kind == JobKind.COMPLETION.value:
        from worker.text_completion import translate_completion

        return translate_completion(
            request,
            request_id=request_id,
            renderer=renderer,
            max_model_len=max_model_len,
            priority=priority,
            quiet_interval=quiet_interval,
        )
    req = ChatCompletionV2Request.model_validate(request)
    plan = plan_tools(req, auto_parser=tool_parser)
    found = constraint_of(req, plan)
    structured = found.kwargs if found is not None else None
    prompt = renderer.render(req, plan)
    max_tokens = completion_budget(req, len(prompt), max_model_len)
    spec = GenerationSpec(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling=sampling_kwargs(
            req,
            max_tokens=max_tokens,
            bench=kind == JobKind.BENCH.value,
            structured=structured,
            quiet_interval=quiet_interval,
        ),
        # Clamped to the documented range, so a row written before bands existed cannot
        # hand the engine an extreme value.
        priority=clamp(req.effective_priority() if priority is None else priority),
    )
    return Translation(
        request=req,
        spec=spec,
        tools=plan,
        echo=echo_prefix(req),
        top_logprobs=(req.top_logprobs or 0) if req.logprobs else None,
        constraint=found,
    )
