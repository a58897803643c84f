"""Response shapes: the completion (seeds 003/004), the chunk (seed 001), the bench
response with its statistics (seed 000), and the text completion and its chunk."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from app.schemas.base import WireModel

Role = Literal["system", "user", "assistant", "developer", "tool", "function"]
FinishReason = Literal["stop", "length", "tool_calls", "content_filter", "function_call", "error"]


class TopLogprob(WireModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(WireModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob]


class Logprobs(WireModel):
    content: list[TokenLogprob] | None = None
    refusal: list[TokenLogprob] | None = None


class ToolCallFunctionOut(WireModel):
    name: str
    arguments: str
    id: str | None = None


class ToolCallOut(WireModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunctionOut
    index: int | None = None


class ResponseMessage(WireModel):
    role: Role = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None
    refusal: str | None = None
    name: str | None = None
    tool_call_id: str | None = None
    function_call: dict[str, Any] | None = None


class Choice(WireModel):
    index: int
    message: ResponseMessage
    logprobs: Logprobs | None = None
    finish_reason: FinishReason | None = None


class PromptTokensDetails(WireModel):
    cached_tokens: int = 0
    audio_tokens: int = 0


class CompletionTokensDetails(WireModel):
    reasoning_tokens: int = 0
    audio_tokens: int = 0
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class Usage(WireModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    completion_tokens_details: CompletionTokensDetails = Field(default_factory=CompletionTokensDetails)


class ChatCompletion(WireModel):
    """`CreateChatCompletionResponse` / `ChatCompletionResponse`."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    service_tier: str | None = None


class DeltaMessage(WireModel):
    role: Role | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    refusal: str | None = None
    function_call: dict[str, Any] | None = None  # legacy `functions`: name, then arguments


class StreamingChoice(WireModel):
    """`StreamingChoiceResponse` (seed 001)."""

    index: int
    delta: DeltaMessage
    logprobs: Logprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(WireModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[StreamingChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    service_tier: str | None = None


# --- text completions (`POST /v1/completions`) ---------------------------------------

TextFinishReason = Literal["stop", "length", "content_filter", "error"]


class TextLogprobs(WireModel):
    """openai-python's `completion_choice.Logprobs`."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class TextChoice(WireModel):
    """`CompletionChoice`."""

    index: int
    text: str
    logprobs: TextLogprobs | None = None
    finish_reason: TextFinishReason | None = None


class TextCompletion(WireModel):
    """`Completion` (`object: "text_completion"`)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[TextChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class TextCompletionChunk(TextCompletion):
    """A streamed piece: the same object with the new text of each choice that moved; the
    last chunk of a stream that asked for `include_usage` has `choices: []` and `usage`."""


class PeakMemoryUsage(WireModel):
    inBytes: int = 0  # noqa: N815 - the seed's spelling


class GenerationStats(WireModel):
    """Measured by the worker for every job: tokens/s and peak memory."""

    prompt_tps: float
    generation_tps: float
    prompt_tokens: int
    generation_tokens: int
    peak_memory_usage: PeakMemoryUsage


class PowerNode(WireModel):
    node_id: str
    samples: int
    avg_sys_power: float


class PowerUsage(WireModel):
    """NVML power samples integrated over the job; absent where there is no sensor."""

    elapsed_seconds: float
    nodes: list[PowerNode]
    total_avg_sys_power_watts: float
    total_energy_joules: float


class BenchChatCompletion(ChatCompletion):
    """`BenchChatCompletionResponse` (seed 000)."""

    generation_stats: GenerationStats | None = None
    power_usage: PowerUsage | None = None


class RecordedStream(WireModel):
    """Seed 002: every chunk of a job's stream, and its usage once it ended. A text
    completion job's chunks are `text_completion` objects."""

    events: list[Annotated[ChatCompletionChunk | TextCompletionChunk, Field(discriminator="object")]]
    usage: Usage | None = None
