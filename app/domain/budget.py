"""How many completion tokens a prompt leaves in the model's context: one rule, used by the
API (with its own token count, before queuing) and the worker (with the rendered prompt)."""

from __future__ import annotations

from app.errors import InvalidRequest
from app.schemas.chat import ChatCompletionV2Request


def completion_budget(req: ChatCompletionV2Request, prompt_tokens: int, max_model_len: int) -> int:
    """The completion tokens a prompt of `prompt_tokens` leaves: what the request asked for,
    else the rest of the context. The API checks with its own count, the worker with the
    rendered prompt. Raises InvalidRequest (`context_length_exceeded`) when it does not fit."""
    room = max_model_len - prompt_tokens
    if room < 1:
        raise InvalidRequest(
            f"This model's maximum context length is {max_model_len} tokens; the messages take "
            f"{prompt_tokens} tokens, leaving no room for the completion",
            param="messages",
            code="context_length_exceeded",
        )
    asked = req.completion_limit()
    if asked is not None and asked > room:
        field = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
        raise InvalidRequest(
            f"This model's maximum context length is {max_model_len} tokens; the messages take "
            f"{prompt_tokens} and `{field}` asks for {asked} more",
            param=field,
            code="context_length_exceeded",
        )
    return asked if asked is not None else room
