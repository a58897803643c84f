"""Scale LLM Engine's v2 batch completions (`scale-llm-engine`'s
`CreateBatchCompletionsV2Request`, `BatchCompletionsJob`), field for field.

`model_config` carries llm-engine's whole vLLM configuration; llmq serves the models its
workers run, so every field there except `model` must be what the client sends when
nothing is asked (null, or the documented defaults below)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from app.domain.metadata import JSON_SCHEMA as METADATA_SCHEMA
from app.schemas.base import WireModel
from app.schemas.batches import OBJECT_PATH_PATTERN

# The values the unchanged client always sends for fields llmq does not manage: these mean
# "nothing asked". Any other value asks for hardware, a checkpoint or an engine setting.
NOTHING_ASKED: dict[str, tuple[Any, ...]] = {
    "num_shards": (None, 1),
    "trust_remote_code": (None, False),
    "response_role": (None, "assistant"),
    "data_parallelism": (None, 1),
}

MAX_RUNTIME_SECONDS = 2 * 24 * 3600


class BatchModelConfig(WireModel):
    """llm-engine's `BatchCompletionsModelConfig` (a `VLLMModelConfig` plus these)."""

    model: str = Field(min_length=1, max_length=256)
    checkpoint_path: str | None = None
    num_shards: int | None = None
    max_context_length: int | None = None
    seed: int | None = None
    response_role: str | None = None
    # VLLMModelConfig: engine settings a deployment chooses, never a request.
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    enforce_eager: bool | None = None
    trust_remote_code: bool | None = None
    pipeline_parallel_size: int | None = None
    tensor_parallel_size: int | None = None
    quantization: str | None = None
    disable_log_requests: bool | None = None
    chat_template: str | None = None
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool | None = None
    load_format: str | None = None
    config_format: str | None = None
    tokenizer_mode: str | None = None
    limit_mm_per_prompt: str | None = None
    max_num_batched_tokens: int | None = None
    tokenizer: str | None = None
    dtype: str | None = None
    revision: str | None = None
    code_revision: str | None = None
    rope_scaling: dict[str, Any] | None = None
    tokenizer_revision: str | None = None
    quantization_param_path: str | None = None
    max_seq_len_to_capture: int | None = None
    disable_sliding_window: bool | None = None
    skip_tokenizer_init: bool | None = None
    served_model_name: str | None = None
    override_neuron_config: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    block_size: int | None = None
    gpu_memory_utilization: float | None = None
    swap_space: float | None = None
    cache_dtype: str | None = None
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool | None = None


class ToolConfig(WireModel):
    name: str
    max_iterations: int | None = None
    execution_timeout_seconds: int | None = None
    should_retry_on_error: bool | None = None


class CreateBatchCompletionsV2Request(WireModel):
    """`content` is a list of chat requests (each with `messages`) or of completion
    requests (each with `prompt`); each item's `model` is `model_config.model`."""

    input_data_path: str | None = Field(
        default=None, max_length=1100, json_schema_extra={"pattern": OBJECT_PATH_PATTERN}
    )
    output_data_path: str = Field(max_length=1100, json_schema_extra={"pattern": OBJECT_PATH_PATTERN})
    labels: dict[str, str] = Field(default_factory=dict, json_schema_extra=METADATA_SCHEMA)
    data_parallelism: int | None = None
    max_runtime_sec: int | None = Field(default=None, ge=1, le=MAX_RUNTIME_SECONDS)
    priority: str | None = Field(
        default=None,
        max_length=16,
        description="An integer, as a string: the priority of every item (lower runs earlier), "
        "within the tenant's band.",
    )
    tool_config: ToolConfig | None = None
    cpus: int | float | str | None = None
    gpus: int | None = None
    memory: str | int | float | None = None
    gpu_type: str | None = None
    storage: str | int | float | None = None
    nodes_per_worker: int | None = None
    content: list[dict[str, Any]] | dict[str, Any] | None = None
    model_config_: BatchModelConfig = Field(alias="model_config")


BatchCompletionsJobStatus = Literal["queued", "running", "completed", "failed", "cancelled", "unknown"]


class BatchCompletionsJob(WireModel):
    job_id: str
    input_data_path: str | None = None
    output_data_path: str
    model_config_: dict[str, Any] = Field(alias="model_config", serialization_alias="model_config")
    priority: str | None = None
    status: BatchCompletionsJobStatus
    created_at: str
    expires_at: str
    completed_at: str | None = None
    metadata: dict[str, str] | None = None


class GetBatchCompletionV2Response(WireModel):
    job: BatchCompletionsJob


class CancelBatchCompletionsV2Response(WireModel):
    success: bool
