"""`ChatCompletionV2Request` (seed 004): every field, typed. What is honoured is decided
by `app.services.contract`, not here: this module only says what is well formed."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field

from app.domain.metadata import JSON_SCHEMA as METADATA_SCHEMA
from app.schemas.base import WireModel

# --- content parts -------------------------------------------------------------------


class TextPart(WireModel):
    type: Literal["text"]
    text: str


class ImageUrl(WireModel):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(WireModel):
    type: Literal["image_url"]
    image_url: ImageUrl


class InputAudio(WireModel):
    data: str
    format: Literal["wav", "mp3"]


class AudioPart(WireModel):
    type: Literal["input_audio"]
    input_audio: InputAudio


class FileRef(WireModel):
    file_data: str | None = None
    file_id: str | None = None
    filename: str | None = None


class FilePart(WireModel):
    type: Literal["file"]
    file: FileRef


class RefusalPart(WireModel):
    type: Literal["refusal"]
    refusal: str


UserPart = Annotated[TextPart | ImagePart | AudioPart | FilePart, Field(discriminator="type")]
AssistantPart = Annotated[TextPart | RefusalPart, Field(discriminator="type")]

# --- messages ------------------------------------------------------------------------


class FunctionCall(WireModel):
    name: str
    arguments: str


class ToolCallFunction(WireModel):
    name: str
    arguments: str


class ToolCall(WireModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class AssistantAudioRef(WireModel):
    id: str


class DeveloperMessage(WireModel):
    role: Literal["developer"]
    content: str | list[TextPart]
    name: str | None = None


class SystemMessage(WireModel):
    role: Literal["system"]
    content: str | list[TextPart]
    name: str | None = None


class UserMessage(WireModel):
    role: Literal["user"]
    content: str | list[UserPart]
    name: str | None = None


class AssistantMessage(WireModel):
    role: Literal["assistant"]
    content: str | list[AssistantPart] | None = None
    refusal: str | None = None
    name: str | None = None
    audio: AssistantAudioRef | None = None
    tool_calls: list[ToolCall] | None = None
    function_call: FunctionCall | None = None


class ToolMessage(WireModel):
    role: Literal["tool"]
    content: str | list[TextPart]
    tool_call_id: str


class FunctionMessage(WireModel):
    role: Literal["function"]
    content: str | None = None
    name: str


Message = Annotated[
    DeveloperMessage | SystemMessage | UserMessage | AssistantMessage | ToolMessage | FunctionMessage,
    Field(discriminator="role"),
]

# --- tools, formats, options ---------------------------------------------------------


class FunctionObject(WireModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(WireModel):
    type: Literal["function"]
    function: FunctionObject


class NamedFunction(WireModel):
    name: str


class NamedToolChoice(WireModel):
    type: Literal["function"]
    function: NamedFunction


class FunctionCallOption(WireModel):
    name: str


class JsonSchemaFormat(WireModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormatText(WireModel):
    type: Literal["text"]


class ResponseFormatJsonObject(WireModel):
    type: Literal["json_object"]


class ResponseFormatJsonSchema(WireModel):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[
    ResponseFormatText | ResponseFormatJsonObject | ResponseFormatJsonSchema,
    Field(discriminator="type"),
]


class AudioOutput(WireModel):
    voice: str
    format: Literal["wav", "aac", "mp3", "flac", "opus", "pcm16"]


class PredictionContent(WireModel):
    type: Literal["content"]
    content: str | list[TextPart]


class StreamOptions(WireModel):
    include_usage: bool | None = None


class WebSearchLocation(WireModel):
    country: str | None = None
    region: str | None = None
    city: str | None = None
    timezone: str | None = None


class UserLocation(WireModel):
    type: Literal["approximate"]
    approximate: WebSearchLocation


class WebSearchOptions(WireModel):
    user_location: UserLocation | None = None
    search_context_size: Literal["low", "medium", "high"] | None = None


# --- the request ---------------------------------------------------------------------


class ChatCompletionV2Request(WireModel):
    """Scale Launch's `ChatCompletionV2Request`, field for field."""

    # The field a prompt over the context is reported on.
    prompt_param: ClassVar[str] = "messages"

    # OpenAI fields.
    messages: list[Message] = Field(min_length=1)
    model: str = Field(min_length=1, max_length=256)
    modalities: list[str] | None = None
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    max_completion_tokens: int | None = Field(default=None, ge=1)
    max_tokens: int | None = Field(default=None, ge=1)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    web_search_options: WebSearchOptions | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    logprobs: bool | None = None
    response_format: ResponseFormat | None = None
    audio: AudioOutput | None = None
    store: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    logit_bias: dict[str, float] | None = None
    n: int | None = Field(default=None, ge=1)
    prediction: PredictionContent | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    function_call: Literal["none", "auto"] | FunctionCallOption | None = None
    functions: list[FunctionObject] | None = Field(default=None, max_length=128)
    metadata: dict[str, str] | None = Field(
        default=None,
        description="Up to 16 string pairs stored with the job and returned on it; "
        "keys up to 64 characters, values up to 512. List filters: `metadata[key]=value`.",
        json_schema_extra=METADATA_SCHEMA,
    )
    user: str | None = None
    service_tier: Literal["auto", "default", "flex"] | None = None

    # vLLM / Launch extensions.
    best_of: int | None = Field(default=None, ge=1)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    early_stopping: bool | Literal["never"] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = Field(default=None, ge=0)
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    echo: bool | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    add_special_tokens: bool | None = None
    documents: list[dict[str, Any]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    priority: int | None = Field(
        default=None,
        ge=-(2**31),
        le=2**31 - 1,
        description="Lower runs earlier; within the tenant's band (0..100 unless an operator sets another).",
    )

    def completion_limit(self) -> int | None:
        """`max_completion_tokens` wins over the deprecated `max_tokens`."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def limit_param(self) -> str:
        """The field `completion_limit` came from, for errors that name it."""
        return "max_completion_tokens" if self.max_completion_tokens else "max_tokens"

    def effective_priority(self) -> int:
        return self.priority or 0
