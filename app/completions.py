"""A completion's wire pieces, built in one place for the worker and the API alike: its id,
its usage, its chunks (the final usage-only chunk included) and the completion object.

These are TypedDicts, not pydantic instances, because chunks are built per flush on the
engine's hot path; each mirrors the model in `app.schemas.completion` that the OpenAPI
document shows (`ChatCompletion`, `ChatCompletionChunk`, `Usage`), and a unit test holds
the two together.
"""

from __future__ import annotations

from typing import Any, Literal, TypedDict


class UsageDict(TypedDict):
    """`Usage`."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int]
    completion_tokens_details: dict[str, int]


class ChunkHeader(TypedDict):
    """What every chunk of one job repeats."""

    id: str
    created: int
    model: str
    system_fingerprint: str | None


class ChunkChoiceDict(TypedDict):
    """`StreamingChoice`."""

    index: int
    delta: dict[str, Any]
    logprobs: dict[str, Any] | None
    finish_reason: str | None


class ChunkDict(TypedDict):
    """`ChatCompletionChunk` as the worker streams it."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    system_fingerprint: str | None
    choices: list[ChunkChoiceDict]
    usage: None


class UsageChunkDict(TypedDict):
    """`ChatCompletionChunk` with no choices: the usage sent last when it was asked for."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChunkChoiceDict]
    usage: dict[str, Any]


class CompletionChoiceDict(TypedDict):
    """`Choice`."""

    index: int
    message: dict[str, Any]
    logprobs: dict[str, Any] | None
    finish_reason: str | None


class CompletionDict(TypedDict):
    """`ChatCompletion`."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[CompletionChoiceDict]
    usage: UsageDict
    system_fingerprint: str | None
    service_tier: str | None


def completion_id(job_id: str) -> str:
    """The completion's id, derived from its job's, so a retry keeps it."""
    return "chatcmpl-" + job_id.removeprefix("job_")


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> UsageDict:
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


def chunk_header(job_id: str, created: int, model: str, system_fingerprint: str | None) -> ChunkHeader:
    return {
        "id": completion_id(job_id),
        "created": created,
        "model": model,
        "system_fingerprint": system_fingerprint,
    }


def chunk(header: ChunkHeader, choices: list[ChunkChoiceDict]) -> ChunkDict:
    return {
        "id": header["id"],
        "object": "chat.completion.chunk",
        "created": header["created"],
        "model": header["model"],
        "system_fingerprint": header.get("system_fingerprint"),
        "choices": choices,
        "usage": None,
    }


def usage_chunk(job_id: str, created: int, model: str, usage: dict[str, Any]) -> UsageChunkDict:
    """The last chunk of a stream whose client asked for `include_usage`."""
    return {
        "id": completion_id(job_id),
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage,
    }


def completion(
    job_id: str,
    created: int,
    model: str,
    choices: list[CompletionChoiceDict],
    usage: UsageDict,
    *,
    system_fingerprint: str | None,
    service_tier: str | None,
) -> CompletionDict:
    return {
        "id": completion_id(job_id),
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage,
        "system_fingerprint": system_fingerprint,
        "service_tier": service_tier,
    }
