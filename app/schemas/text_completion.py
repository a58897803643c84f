"""OpenAI's legacy text completions (`POST /v1/completions`): the request, with the vLLM
extensions this engine honours. The response and chunk shapes (openai-python's
`Completion`, `CompletionChoice`, `Logprobs`) are in `app.schemas.completion`. What is honoured is decided by
`app.services.completion_contract`; this module only says what is well formed.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

from pydantic import Field

from app.domain.metadata import JSON_SCHEMA as METADATA_SCHEMA
from app.schemas.base import WireModel
from app.schemas.chat import ChatCompletionV2Request, ResponseFormat, StreamOptions

# OpenAI's default when `max_tokens` is left out (vLLM's completions server keeps it).
DEFAULT_MAX_TOKENS = 16

TokenIds = Annotated[list[int], Field(min_length=1)]


class CompletionRequest(WireModel):
    """OpenAI's `CreateCompletionRequest`, with vLLM's sampling extensions.

    `prompt` is one prompt: a string, or token ids. OpenAI also takes a list of prompts;
    one llmq job runs one engine request, so a list is accepted only when it holds a
    single prompt (several prompts are several requests, or a batch)."""

    prompt_param: ClassVar[str] = "prompt"

    model: str = Field(min_length=1, max_length=256)
    prompt: str | list[str] | TokenIds | list[TokenIds] = Field(
        description="One prompt: a string, token ids, or a list holding exactly one of those."
    )
    suffix: str | None = None
    max_tokens: int | None = Field(default=None, ge=1, description="Default 16, as OpenAI's.")
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int | None = Field(default=None, ge=1)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    best_of: int | None = Field(default=None, ge=1)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    metadata: dict[str, str] | None = Field(
        default=None,
        description="Up to 16 string pairs stored with the job and returned on it.",
        json_schema_extra=METADATA_SCHEMA,
    )

    # vLLM extensions.
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = Field(default=None, ge=0)
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    add_special_tokens: bool | None = Field(default=None, description="Default true, as vLLM's.")
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    priority: int | None = Field(
        default=None,
        ge=-(2**31),
        le=2**31 - 1,
        description="Lower runs earlier; within the tenant's band (0..100 unless an operator sets another).",
    )

    def completion_limit(self) -> int:
        return self.max_tokens if self.max_tokens is not None else DEFAULT_MAX_TOKENS

    def limit_param(self) -> str:
        return "max_tokens"

    def effective_priority(self) -> int:
        return self.priority or 0

    def single_prompt(self) -> str | list[int]:
        """The one prompt, text or token ids (a list of one prompt unwrapped). Raises
        ValueError when the list holds more or fewer than one prompt (the policy refuses
        such a request before this is called)."""
        p = self.prompt
        if isinstance(p, str):
            return p
        items: list[Any] = list(p)
        if items and all(isinstance(x, int) for x in items):
            return [int(x) for x in items]
        if len(items) != 1:
            raise ValueError(f"{len(items)} prompts; one is served per request")
        only = items[0]
        return only if isinstance(only, str) else [int(x) for x in only]


# Either request a job runs: a chat completion (kinds `chat`, `bench`) or a text completion.
JobRequest = ChatCompletionV2Request | CompletionRequest
