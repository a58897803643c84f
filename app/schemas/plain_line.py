"""The plain shape of a batch input line: a chat request whose messages are text (a role
of system, developer, user or assistant, string content, an optional name) and whose other
fields are among the common sampling fields below.

Most input files hold nothing else, and validating such a line with the full
`ChatCompletionV2Request` (sixty fields, a union of six message types) and then running
every check of the request policy is most of an upload's time. The plain shape is only
ever a shortcut to *accepting* a line: a line it does not fit, or one the plain checks do
not pass, goes through the full model and policy, which name what is wrong. Its fields
take their defaults and bounds from the full request's own fields, and
tests/unit/test_plain_line.py checks on generated lines that both ways give the same
answer.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from app.schemas.base import WireModel
from app.schemas.batches import BatchInputLine
from app.schemas.chat import ChatCompletionV2Request


def _as_in(model: type[WireModel], name: str) -> Any:
    """`model`'s field `name` (its default and bounds) for a field of the plain shape."""
    return model.model_fields[name]


class PlainMessage(WireModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str
    name: str | None = None


class PlainChatBody(WireModel):
    """Every field here is honoured as it is (app/services/contract.py's `HONOURED`) and
    read by no check but the bounds (`check_bounds`)."""

    messages: list[PlainMessage] = Field(min_length=1)
    model: str = _as_in(ChatCompletionV2Request, "model")
    max_completion_tokens: int | None = _as_in(ChatCompletionV2Request, "max_completion_tokens")
    max_tokens: int | None = _as_in(ChatCompletionV2Request, "max_tokens")
    frequency_penalty: float | None = _as_in(ChatCompletionV2Request, "frequency_penalty")
    presence_penalty: float | None = _as_in(ChatCompletionV2Request, "presence_penalty")
    stop: str | list[str] | None = _as_in(ChatCompletionV2Request, "stop")
    n: int | None = _as_in(ChatCompletionV2Request, "n")
    seed: int | None = _as_in(ChatCompletionV2Request, "seed")
    temperature: float | None = _as_in(ChatCompletionV2Request, "temperature")
    top_p: float | None = _as_in(ChatCompletionV2Request, "top_p")

    def completion_limit(self) -> int | None:
        """As `ChatCompletionV2Request.completion_limit`."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class PlainBatchLine(WireModel):
    custom_id: str = _as_in(BatchInputLine, "custom_id")
    method: Literal["POST"]
    url: Literal["/v1/chat/completions", "/v2/chat/completions"]
    body: PlainChatBody
