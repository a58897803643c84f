"""The one typed configuration object, read from `LLMQ_*` environment variables.

Build it once (``Settings()``) at the edge of a process and pass it down; nothing else
reads the environment.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    """Every knob llmq has. Defaults are what a single-machine deployment wants."""

    model_config = SettingsConfigDict(
        env_prefix="LLMQ_", env_file=None, extra="ignore", protected_namespaces=()
    )

    # Stores. Unset means "embedded" for `llmq up`; the API and worker require them.
    database_url: str | None = None
    redis_url: str | None = None
    data_dir: Path = Path(".llmq")

    # Model and engine. `instant` answers at once without a model: for overhead
    # benchmarks only, never a default.
    engine: Literal["vllm", "instant"] = "vllm"
    instant_token_seconds: float = Field(
        default=0.0, ge=0, description="Instant engine only: delay per token."
    )
    model: str | None = Field(default=None, description="Local model folder or a name the engine resolves.")
    served_model_name: str | None = Field(
        default=None, description="Name clients use; defaults to the model folder's name."
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        default="auto", description="auto: float32 on CPU, the model's own dtype on GPU."
    )
    max_model_len: int | None = Field(default=None, ge=16)
    max_num_seqs: int = Field(default=64, ge=1)
    kv_cache_space_gib: float = Field(
        default=2.0, gt=0, description="KV cache size on the CPU engine (VLLM_CPU_KVCACHE_SPACE)."
    )
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    structured_output_backend: Literal["guidance", "xgrammar", "outlines", "auto"] = "guidance"
    engine_seed: int = 0
    enforce_eager: bool | None = Field(
        default=None, description="Skip graph capture/compilation; default: on for CPU, off for GPU."
    )
    pin_engine_core: bool = Field(
        default=True, description="On CPU, run vLLM's spinning engine core on the model's cores."
    )
    max_inflight: int | None = Field(
        default=None, ge=1, description="Jobs in flight per worker; default 2 x max_num_seqs."
    )

    # Request bounds, enforced before anything is queued.
    max_n: int = Field(default=8, ge=1)
    max_tokens_limit: int = Field(default=4096, ge=1)
    max_messages: int = Field(default=1000, ge=1)
    max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    max_json_depth: int = Field(default=64, ge=4)
    max_stop_sequences: int = 4

    # Batches.
    max_upload_bytes: int = Field(default=200 * 1024 * 1024, ge=1024)
    max_batch_lines: int = Field(default=50_000, ge=1)
    batch_chunk_size: int = Field(default=32, ge=1, description="Batch lines per broker message.")
    batch_dispatch_window: int = Field(
        default=512, ge=1, description="Batch lines sent to the broker and not yet finished, per model."
    )
    batch_tick_seconds: float = Field(default=0.2, gt=0, description="How often the batch feeder runs.")

    # Templates and tools.
    allow_custom_chat_template: bool = Field(
        default=False,
        description="Render user `chat_template`s (in a sandbox process) instead of refusing them.",
    )
    max_chat_template_bytes: int = Field(default=64 * 1024, ge=1)
    chat_template_timeout_seconds: float = Field(default=2.0, gt=0)
    tool_call_parser: str | None = Field(
        default=None,
        description="vLLM tool parser for `tool_choice: auto` (e.g. hermes); unset refuses auto.",
    )
    api_counts_prompt_tokens: bool = Field(
        default=True,
        description="Count prompt tokens in the API (400 before queuing) when the model is local.",
    )

    # Limits per API key.
    rate_limit_per_minute: int = Field(
        default=6000, ge=0, description="Requests per minute per key; 0 turns it off."
    )
    rate_limit_burst: int = Field(default=500, ge=1)
    max_active_jobs_per_tenant: int = Field(
        default=2000,
        ge=0,
        description="Single jobs queued or running per tenant (batch lines apart); 0: no cap.",
    )
    max_streams_per_key: int = Field(
        default=32, ge=0, description="SSE streams and file downloads open at once per key; 0: no cap."
    )
    idempotency_ttl_seconds: int = Field(
        default=24 * 3600, ge=60, description="How long an Idempotency-Key holds."
    )

    # Auth.
    bootstrap_api_key: str | None = Field(
        default=None, description="Registered for the default tenant at start-up."
    )
    default_tenant: str = "default"

    # Reliability.
    lease_seconds: float = Field(default=30.0, gt=0)
    sweeper_interval_seconds: float = Field(default=5.0, gt=0)
    requeue_grace_seconds: float = Field(
        default=30.0, ge=0, description="Age after which a queued job with no message is re-sent."
    )
    max_attempts: int = Field(default=3, ge=1)
    job_timeout_seconds: float = Field(default=3600.0, gt=0)
    visibility_timeout_seconds: int = Field(
        default=4 * 3600, description="Broker redelivery timeout; above the longest job."
    )
    cancel_wait_seconds: float = Field(default=5.0, ge=0)
    sync_wait_seconds: float = Field(
        default=300.0, ge=0, description="How long /v1/chat/completions waits before answering 202."
    )
    sse_heartbeat_seconds: float = Field(default=15.0, gt=0, description="Keep-alive comment interval.")
    stream_key_check_seconds: float = Field(
        default=5.0, gt=0, description="How often an open stream re-checks that its key is still valid."
    )
    db_pool_size: int = Field(
        default=10, ge=1, description="Pooled Postgres connections per API process (as many again overflow)."
    )
    db_pool_timeout_seconds: float = Field(
        default=10.0, gt=0, description="How long a request waits for a pooled connection before a 503."
    )
    worker_heartbeat_seconds: float = Field(default=5.0, gt=0)
    shutdown_grace_seconds: float = Field(
        default=20.0, ge=0, description="On SIGTERM, how long running jobs may finish."
    )

    # Logging.
    log_level: str = "INFO"
    log_json: bool = False

    @property
    def model_name(self) -> str:
        """The name clients put in `model`."""
        if self.served_model_name:
            return self.served_model_name
        if self.model:
            return Path(self.model.rstrip("/")).name or self.model
        return "unconfigured"

    @property
    def inflight_limit(self) -> int:
        """How many jobs one worker runs at once (vLLM's own figure is about 2x seqs)."""
        return self.max_inflight or 2 * self.max_num_seqs

    def require_database_url(self) -> str:
        if not self.database_url:
            raise RuntimeError("LLMQ_DATABASE_URL is not set (use `llmq up` for embedded stores)")
        return self.database_url

    def require_redis_url(self) -> str:
        if not self.redis_url:
            raise RuntimeError("LLMQ_REDIS_URL is not set (use `llmq up` for embedded stores)")
        return self.redis_url
