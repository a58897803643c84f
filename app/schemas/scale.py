"""Scale's LLM Engine v1 completions (`scale-llm-engine` 0.0.0b45, `llmengine/data_types/
completion.py` and `core.py`): the request the unchanged client sends to
`/v1/llm/completions-sync` and `-stream`, and the shapes it parses back."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from app.schemas.base import WireModel


class CompletionSyncV1Request(WireModel):
    """`CompletionSyncV1Request` (and `CompletionStreamV1Request`, field for field). The
    client sends every field, unset ones as null."""

    prompt: str
    max_new_tokens: int = Field(ge=1)
    temperature: float = Field(ge=0.0, le=1.0, description="0 is greedy sampling.")
    stop_sequences: list[str] | None = None
    return_token_log_probs: bool | None = False
    presence_penalty: float | None = Field(default=None, ge=0.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=0.0, le=2.0)
    top_k: int | None = Field(default=None, ge=-1)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    include_stop_str_in_output: bool | None = None
    guided_json: dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    skip_special_tokens: bool | None = True


class CompletionStreamV1Request(CompletionSyncV1Request):
    """`CompletionStreamV1Request`: the same fields."""


class TokenOutput(WireModel):
    token: str
    log_prob: float


class CompletionOutput(WireModel):
    text: str
    num_prompt_tokens: int | None = None
    num_completion_tokens: int
    tokens: list[TokenOutput] | None = None


class CompletionSyncV1Response(WireModel):
    """`request_id` is the llmq job's id: `GET /v2/jobs/<request_id>` reads the job."""

    request_id: str
    output: CompletionOutput


class CompletionStreamOutput(WireModel):
    text: str
    finished: bool
    num_prompt_tokens: int | None = None
    num_completion_tokens: int | None = None
    token: TokenOutput | None = None


class StreamErrorContent(WireModel):
    error: str
    timestamp: str


class StreamError(WireModel):
    status_code: int
    content: StreamErrorContent


class CompletionStreamV1Response(WireModel):
    """One `data:` event of a stream: an output, or (last) an error. No `data: [DONE]`
    follows: the client would try to parse it as JSON and raise."""

    request_id: str
    output: CompletionStreamOutput | None = None
    error: StreamError | None = None
