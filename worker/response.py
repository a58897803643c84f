"""Accumulated engine output → the completion object (seeds 003/004) and its usage."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from app.completions import CompletionDict, UsageDict, completion
from app.domain.tools import ToolPlan, parse_constrained
from worker.engine import ChoiceDelta, TokenLogprob
from worker.store import Claim

# (text, request) → (content, tool calls), or None when the parser found no call.
ToolExtractor = Callable[[str, dict[str, Any]], tuple[str | None, list[dict[str, Any]]] | None]


def logprob_entry(lp: TokenLogprob) -> dict[str, Any]:
    """OpenAI's `ChatCompletionTokenLogprob`."""
    return {
        "token": lp.token,
        "logprob": lp.logprob,
        "bytes": lp.token_bytes,
        "top_logprobs": [{"token": t, "logprob": p, "bytes": b} for t, p, b in lp.top],
    }


class ChoiceState:
    """Everything one choice produced so far."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.parts: list[str] = []
        self.tokens = 0
        self.finish_reason: str | None = None
        self.logprobs: list[dict[str, Any]] = []

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def add(self, delta: ChoiceDelta) -> None:
        if delta.text:
            self.parts.append(delta.text)
        self.tokens += len(delta.token_ids)
        if delta.logprobs:
            self.logprobs.extend(logprob_entry(lp) for lp in delta.logprobs)
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason


@dataclass(frozen=True)
class FinalChoice:
    index: int
    message: dict[str, Any]
    finish_reason: str | None
    logprobs: list[dict[str, Any]] | None

    @property
    def tool_calls(self) -> list[dict[str, Any]]:
        calls = self.message.get("tool_calls") or []
        if self.message.get("function_call"):
            calls = [{"id": None, "type": "function", "function": self.message["function_call"]}]
        return list(calls)


# vLLM reports a choice cut short by an abort as "abort", which is not in the API's
# finish_reason set; "stop" would claim the model ended its answer. "error" is the member
# of the set that says the choice did not end normally (the job's status says cancelled).
ABORTED = "error"


def aborted_as(reason: str | None) -> str | None:
    """The wire finish_reason for the engine's `reason`."""
    return ABORTED if reason == "abort" else reason


def finalize(
    choice: ChoiceState,
    *,
    job_id: str,
    plan: ToolPlan,
    echo: str,
    logprobs: bool,
    request: dict[str, Any],
    extract: ToolExtractor | None,
) -> FinalChoice:
    """The choice's message: text, or tool calls when the plan asked for them and the
    output holds them. An aborted choice reports `error` (see ABORTED)."""
    reason = aborted_as(choice.finish_reason)
    text = choice.text
    calls: list[dict[str, Any]] | None = None
    content: str | None = echo + text
    if plan.mode in ("named", "required"):
        calls = parse_constrained(plan, text, job_id, choice.index)
    elif plan.mode == "auto" and extract is not None:
        found = extract(text, request)
        if found is not None:
            content, calls = found
    message: dict[str, Any] = {"role": "assistant", "content": content, "tool_calls": None}
    if calls:
        message["content"] = content if plan.mode == "auto" else None
        if plan.legacy:
            message["function_call"] = calls[0]["function"]
            reason = "function_call" if reason == "stop" else reason
        else:
            message["tool_calls"] = calls
            reason = "tool_calls" if reason == "stop" else reason
    return FinalChoice(choice.index, message, reason, choice.logprobs if logprobs else None)


def build_completion(
    claim: Claim,
    choices: list[FinalChoice],
    usage: UsageDict,
    *,
    system_fingerprint: str,
    service_tier: str | None,
) -> CompletionDict:
    return completion(
        claim.job_id,
        int(claim.created_at.timestamp()),
        claim.model,
        [
            {
                "index": c.index,
                "message": c.message,
                "logprobs": {"content": c.logprobs} if c.logprobs is not None else None,
                "finish_reason": c.finish_reason,
            }
            for c in choices
        ],
        usage,
        system_fingerprint=system_fingerprint,
        service_tier=service_tier,
    )
