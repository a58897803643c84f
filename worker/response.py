"""Accumulated engine output → the completion object (seeds 003/004) and its usage."""

from __future__ import annotations

from typing import Any

from worker.engine import ChoiceDelta
from worker.store import Claim


class ChoiceState:
    """Everything one choice produced so far."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.parts: list[str] = []
        self.tokens = 0
        self.finish_reason: str | None = None
        self.logprobs: list[dict[str, Any]] | None = None

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def add(self, delta: ChoiceDelta) -> None:
        if delta.text:
            self.parts.append(delta.text)
        self.tokens += len(delta.token_ids)
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason

    def openai_finish_reason(self) -> str | None:
        # An aborted choice is reported as stopped; the job's status says it was cancelled.
        if self.finish_reason == "abort":
            return "stop"
        return self.finish_reason


def build_usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens, "audio_tokens": 0},
        "completion_tokens_details": {
            "reasoning_tokens": 0,
            "audio_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    }


def completion_id(job_id: str) -> str:
    return "chatcmpl-" + job_id.removeprefix("job_")


def build_completion(
    claim: Claim,
    choices: list[ChoiceState],
    usage: dict[str, Any],
    *,
    system_fingerprint: str,
    service_tier: str | None,
) -> dict[str, Any]:
    return {
        "id": completion_id(claim.job_id),
        "object": "chat.completion",
        "created": int(claim.created_at.timestamp()),
        "model": claim.model,
        "choices": [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text, "tool_calls": None},
                "logprobs": {"content": c.logprobs} if c.logprobs is not None else None,
                "finish_reason": c.openai_finish_reason(),
            }
            for c in choices
        ],
        "usage": usage,
        "system_fingerprint": system_fingerprint,
        "service_tier": service_tier,
    }
