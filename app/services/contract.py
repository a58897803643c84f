"""Which request fields this deployment honours, and the bounds it enforces.

Nothing is accepted and ignored: a field is either in `HONOURED`, or set to its neutral
value (the value that changes nothing), or the request is refused with a 400 naming it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from app.errors import InvalidRequest, NotFound, Unsupported
from app.schemas.chat import (
    AssistantMessage,
    ChatCompletionV2Request,
    TextPart,
)
from app.settings import Settings

# Fields the engine path implements; every other set field must be neutral.
HONOURED: frozenset[str] = frozenset(
    {
        "messages",
        "model",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "stop",
        "n",
        "ignore_eos",
        "priority",
        # Streaming: the chat endpoints relay SSE; see `check` for POST /v2/jobs.
        "stream",
        "stream_options",
        # Stored with the job, returned on it.
        "metadata",
        "user",
        "service_tier",
        "store",
    }
)


def _is(*values: Any) -> Callable[[Any], bool]:
    return lambda v: v in values


def _empty(v: Any) -> bool:
    return not v


# A set field with a neutral value asks for exactly what happens anyway.
NEUTRAL: dict[str, Callable[[Any], bool]] = {
    "logprobs": _is(False),
    "top_logprobs": _is(0),
    "echo": _is(False),
    "add_generation_prompt": _is(True),
    "continue_final_message": _is(False),
    "add_special_tokens": _is(False),
    "skip_special_tokens": _is(True),
    "spaces_between_special_tokens": _is(True),
    "include_stop_str_in_output": _is(False),
    "use_beam_search": _is(False),
    "min_tokens": _is(0),
    "repetition_penalty": _is(1.0),
    "presence_penalty": _is(0.0),
    "frequency_penalty": _is(0.0),
    "stop_token_ids": _empty,
    "logit_bias": _empty,
    "documents": _empty,
    "chat_template_kwargs": _empty,
    "tools": _empty,
    "functions": _empty,
    "tool_choice": _is("none"),
    "function_call": _is("none"),
    "modalities": _is(["text"]),
    "response_format": lambda v: v.get("type") == "text",
}

WHY_UNSUPPORTED: dict[str, str] = {
    "modalities": "this engine generates text only",
    "audio": "this engine does not generate audio",
    "prediction": "predicted outputs are not supported by this engine",
    "web_search_options": "this engine has no web search",
    "reasoning_effort": "the served model has no reasoning-effort control",
}


class RequestPolicy:
    """Checks a parsed request against what this deployment runs. Raises, or returns."""

    def __init__(self, settings: Settings, served_models: frozenset[str]) -> None:
        self._settings = settings
        self._served = served_models

    def check(self, req: ChatCompletionV2Request, *, streaming: bool = False) -> None:
        """`streaming`: the endpoint can answer `stream: true` (the chat endpoints can;
        `POST /v2/jobs` answers 202 and streams from `/v2/jobs/<id>/stream`).

        Raises:
        NotFound: `model` is not served here.
        Unsupported: a field set to something this deployment does not honour.
        InvalidRequest: a bound is exceeded or fields contradict each other.
        """
        if req.model not in self._served:
            raise NotFound(
                f"The model `{req.model}` does not exist or is not served here; "
                f"served: {', '.join(sorted(self._served))}",
                param="model",
                code="model_not_found",
            )
        if req.stream and not streaming:
            raise InvalidRequest(
                "`stream: true` is for /v1/chat/completions and /v2/chat/completions; a queued "
                "job streams from GET /v2/jobs/<id>/stream",
                param="stream",
            )
        self._check_fields(req)
        self._check_bounds(req)
        self._check_messages(req)

    def _check_fields(self, req: ChatCompletionV2Request) -> None:
        dumped = req.model_dump(exclude_none=True, by_alias=True)
        for name in req.model_fields_set:
            if name in HONOURED or name not in dumped:
                continue
            neutral = NEUTRAL.get(name)
            if neutral is not None and neutral(dumped[name]):
                continue
            if name == "best_of" and dumped[name] == (req.n or 1):
                continue
            why = WHY_UNSUPPORTED.get(name, "this deployment does not honour it yet")
            raise Unsupported(f"`{name}` is not supported: {why}", param=name)

    def _check_bounds(self, req: ChatCompletionV2Request) -> None:
        s = self._settings
        if req.n is not None and req.n > s.max_n:
            raise InvalidRequest(f"`n` is {req.n}; the limit is {s.max_n}", param="n")
        limit = req.completion_limit()
        if limit is not None and limit > s.max_tokens_limit:
            field = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
            raise InvalidRequest(f"`{field}` is {limit}; the limit is {s.max_tokens_limit}", param=field)
        if len(req.messages) > s.max_messages:
            raise InvalidRequest(
                f"{len(req.messages)} messages; the limit is {s.max_messages}", param="messages"
            )
        if isinstance(req.stop, list) and len(req.stop) > s.max_stop_sequences:
            raise InvalidRequest(
                f"`stop` has {len(req.stop)} sequences; the limit is {s.max_stop_sequences}",
                param="stop",
            )

    def _check_messages(self, req: ChatCompletionV2Request) -> None:
        for i, msg in enumerate(req.messages):
            content = getattr(msg, "content", None)
            if isinstance(content, list):
                for j, part in enumerate(content):
                    if not isinstance(part, TextPart) and getattr(part, "type", "") != "refusal":
                        raise Unsupported(
                            f"content part type `{part.type}` is not supported: "
                            "the served model is text-only",
                            param=f"messages[{i}].content[{j}].type",
                        )
            if isinstance(msg, AssistantMessage):
                if msg.audio is not None:
                    raise Unsupported(
                        "assistant `audio` references are not supported: text-only model",
                        param=f"messages[{i}].audio",
                    )
                if msg.tool_calls or msg.function_call:
                    raise Unsupported(
                        "assistant tool calls in the history are not supported yet",
                        param=f"messages[{i}].tool_calls",
                    )
            if msg.role in ("tool", "function"):
                raise Unsupported(f"`{msg.role}` messages are not supported yet", param=f"messages[{i}].role")
