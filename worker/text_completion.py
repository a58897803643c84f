"""Text completions in the worker: a stored `CompletionRequest` → what the engine runs (the
prompt's token ids, no chat template, and `SamplingParams` keyword arguments), and the
engine's output → the `text_completion` object."""

from __future__ import annotations

from typing import Any

from app.completions import UsageDict
from app.domain.budget import completion_budget
from app.domain.structured import constraint_of
from app.domain.text_prompt import echo_text, prompt_ids
from app.domain.tools import ToolPlan
from app.schemas.text_completion import CompletionRequest
from app.services.priority import clamp
from app.text_completions import TextChoiceDict, TextCompletionDict, text_completion, text_logprobs
from worker.engine import GenerationSpec
from worker.response import ChoiceState, aborted_as
from worker.translate import Renderer, Translation, sampling_kwargs

NO_TOOLS = ToolPlan("none")


def translate_completion(
    request: dict[str, Any],
    *,
    request_id: str,
    renderer: Renderer,
    max_model_len: int,
    priority: int | None = None,
    quiet_interval: int = 1,
) -> Translation:
    """Raises:
    InvalidRequest: the prompt does not fit the model's context (a 400 for this job only).
    """
    req = CompletionRequest.model_validate(request)
    found = constraint_of(req, NO_TOOLS)
    prompt = prompt_ids(req, renderer)
    max_tokens = completion_budget(req, len(prompt), max_model_len)
    spec = GenerationSpec(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling=sampling_kwargs(
            req,
            max_tokens=max_tokens,
            bench=False,
            structured=found.kwargs if found is not None else None,
            quiet_interval=quiet_interval,
        ),
        priority=clamp(req.effective_priority() if priority is None else priority),
    )
    return Translation(
        request=req,
        spec=spec,
        tools=NO_TOOLS,
        echo=echo_text(req, prompt, renderer),
        top_logprobs=req.logprobs,
        constraint=found,
        text=True,
    )


def text_choices(
    choices: list[ChoiceState],
    *,
    echo: str,
    logprobs: bool,
    prompt_logprobs: list[dict[str, Any]] | None = None,
) -> list[TextChoiceDict]:
    """Each choice's text (the echoed prompt first) and legacy logprobs (the echoed
    prompt's tokens first, when the engine gave them); an aborted choice reports `error`,
    as chat's do (worker/response.py's ABORTED)."""
    if prompt_logprobs is not None:
        lead, start = prompt_logprobs, 0
    else:
        lead, start = [], len(echo)
    return [
        {
            "index": c.index,
            "text": echo + c.text,
            "logprobs": text_logprobs(lead + c.logprobs, start) if logprobs else None,
            "finish_reason": aborted_as(c.finish_reason),
        }
        for c in choices
    ]


def build_text_completion(
    job_id: str,
    created: int,
    model: str,
    choices: list[TextChoiceDict],
    usage: UsageDict,
    *,
    system_fingerprint: str,
) -> TextCompletionDict:
    return text_completion(job_id, created, model, choices, usage, system_fingerprint=system_fingerprint)
