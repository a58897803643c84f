"""A text completion's wire pieces (`object: "text_completion"`), built in one place for
the worker and the API alike: its id, its choices with OpenAI's legacy logprobs, its chunks
and the usage-only last chunk. TypedDicts mirroring `app.schemas.text_completion`, as
`app.completions` does for chat (a unit test holds the two together).
"""

from __future__ import annotations

from typing import Any, Literal, TypedDict

from app.completions import ChunkHeader, UsageDict


class TextLogprobsDict(TypedDict):
    """`Logprobs`: per token its text, logprob, alternatives and offset in the choice's text."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class TextChoiceDict(TypedDict):
    """`CompletionChoice`."""

    index: int
    text: str
    logprobs: TextLogprobsDict | None
    finish_reason: str | None


class TextCompletionDict(TypedDict):
    """`Completion`."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[TextChoiceDict]
    usage: UsageDict | None
    system_fingerprint: str | None


def text_completion_id(job_id: str) -> str:
    """The completion's id, derived from its job's, so a retry keeps it."""
    return "cmpl-" + job_id.removeprefix("job_")


def text_logprobs(entries: list[dict[str, Any]], start_offset: int) -> TextLogprobsDict:
    """OpenAI's legacy logprobs from the chat-shaped entries the worker collects
    (`{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}`).

    `text_offset` counts characters from the start of the choice's text (`start_offset`
    is where these tokens begin: the echoed prompt's length, or the text streamed so far).
    `top_logprobs` holds the sampled token first, then the alternatives, as vLLM's server
    answers (so `logprobs: 0` still names the sampled token)."""
    out: TextLogprobsDict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = start_offset
    for entry in entries:
        token = str(entry["token"])
        out["tokens"].append(token)
        out["token_logprobs"].append(float(entry["logprob"]))
        top = {token: float(entry["logprob"])}
        for alt in entry.get("top_logprobs") or []:
            top.setdefault(str(alt["token"]), float(alt["logprob"]))
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(token)
    return out


def text_completion(
    job_id: str,
    created: int,
    model: str,
    choices: list[TextChoiceDict],
    usage: UsageDict | None,
    *,
    system_fingerprint: str | None,
) -> TextCompletionDict:
    """The completion, or (with the choices that moved and no usage) one of its chunks."""
    return {
        "id": text_completion_id(job_id),
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage,
        "system_fingerprint": system_fingerprint,
    }


def text_chunk(header: ChunkHeader, choices: list[TextChoiceDict]) -> TextCompletionDict:
    """One streamed chunk: the choices that moved since the last, no usage."""
    return {
        "id": header["id"],
        "object": "text_completion",
        "created": header["created"],
        "model": header["model"],
        "choices": choices,
        "usage": None,
        "system_fingerprint": header.get("system_fingerprint"),
    }


def text_usage_chunk(job_id: str, created: int, model: str, usage: dict[str, Any]) -> dict[str, Any]:
    """The last chunk of a stream whose client asked for `include_usage`."""
    return {
        "id": text_completion_id(job_id),
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage,
        "system_fingerprint": None,
    }
