"""How many completion tokens a prompt leaves in the model's context: one rule, used by the
API (with its own token count, before queuing) and the worker (with the rendered prompt)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from pydantic_core import to_json

from app.errors import InvalidRequest
from app.schemas.text_completion import CompletionRequest, JobRequest


def completion_budget(req: JobRequest, prompt_tokens: int, max_model_len: int) -> int:
    """The completion tokens a prompt of `prompt_tokens` leaves: what the request asked for,
    else the rest of the context. The API checks with its own count, the worker with the
    rendered prompt. Raises InvalidRequest (`context_length_exceeded`) when it does not fit."""
    room = max_model_len - prompt_tokens
    what = "the messages take" if req.prompt_param == "messages" else "the prompt takes"
    if room < 1:
        raise InvalidRequest(
            f"This model's maximum context length is {max_model_len} tokens; {what} "
            f"{prompt_tokens} tokens, leaving no room for the completion",
            param=req.prompt_param,
            code="context_length_exceeded",
        )
    asked = req.completion_limit()
    if asked is not None and asked > room:
        field = req.limit_param()
        raise InvalidRequest(
            f"This model's maximum context length is {max_model_len} tokens; {what} "
            f"{prompt_tokens} and `{field}` asks for {asked} more",
            param=field,
            code="context_length_exceeded",
        )
    return asked if asked is not None else room


# --- batch token budgets (app/services/budgets.py) --------------------------------------

BYTES_PER_TOKEN = 4


def estimate_prompt_tokens(req: JobRequest) -> int:
    """Prompt tokens without the model's tokenizer: the UTF-8 bytes of the messages and
    tools as JSON, over 4. English text runs at about 4 bytes a token, and the JSON's keys
    and quotes stand in for the chat template's own tokens; text in scripts that tokenize
    densely (CJK, digits) can take more than the estimate."""
    if isinstance(req, CompletionRequest):
        prompt = req.single_prompt()
        if isinstance(prompt, list):
            return len(prompt)
        return -(-len(prompt.encode("utf-8")) // BYTES_PER_TOKEN)
    return estimate_chat_tokens(req.messages, req.tools)


def estimate_chat_tokens(messages: Sequence[Any], tools: Any) -> int:
    """`estimate_prompt_tokens` of a chat request's messages (models) and tools (or None)."""
    parts: list[Any] = list(messages)
    if tools:
        parts.append(tools)
    # Compact JSON straight from the models, in pydantic-core: every line of an upload pays
    # this, and dumping to dicts and then `json.dumps` cost 20 µs a line against 3.
    size = len(to_json(parts, exclude_none=True))
    return -(-size // BYTES_PER_TOKEN)


class Limited(Protocol):
    """What `line_tokens` reads of a request (a chat or text completion, a plain batch line's body)."""

    def completion_limit(self) -> int | None: ...


def line_tokens(req: Limited, prompt_tokens: int, max_model_len: int | None, fallback: int) -> int:
    """A batch line's figure against its tenant's batch token budget: its prompt tokens
    plus the completion tokens it may generate: what it asked for (`max_completion_tokens`
    or `max_tokens`), else the rest of the context when the context length is known, else
    `fallback` (LLMQ_MAX_TOKENS_LIMIT)."""
    asked = req.completion_limit()
    if asked is not None:
        completion = asked
    elif max_model_len is not None:
        completion = max(max_model_len - prompt_tokens, 0)
    else:
        completion = fallback
    return prompt_tokens + completion
