"""The one typed configuration object, read from `LLMQ_*` environment variables.

Build it once (``Settings()``) at the edge of a process and pass it down; nothing else
reads the environment.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from app.domain.webhooks import RetrySchedule


class Settings(BaseSettings):
    """Every knob llmq has. Defaults are what a single-machine deployment wants."""

    model_config = SettingsConfigDict(
        env_prefix="LLMQ_", env_file=None, extra="ignore", protected_namespaces=()
    )

    # Stores. Unset means "embedded" for `llmq up`; the API and worker require them.
    database_url: str | None = None
    redis_url: str | None = None
    data_dir: Path = Path(".llmq")

    # Model and engine. `instant` answers at once without a model, `simulated` spends time
    # like a continuous-batching GPU engine without one (worker/sim_engine.py): for
    # benchmarks and fleet tests only, never a default.
    engine: Literal["vllm", "instant", "simulated"] = "vllm"
    instant_token_seconds: float = Field(
        default=0.0, ge=0, description="Instant engine only: delay per token."
    )
    sim_step_ms: float = Field(
        default=8.0, ge=0, description="Simulated engine only: fixed cost of one decode step (ms)."
    )
    sim_step_ms_per_seq: float = Field(
        default=0.08, ge=0, description="Simulated engine only: added step cost per running sequence (ms)."
    )
    sim_prefill_ms_per_token: float = Field(
        default=0.05, ge=0, description="Simulated engine only: step cost per prompt token admitted (ms)."
    )
    model: str | None = Field(default=None, description="Local model folder or a name the engine resolves.")
    served_model_name: str | None = Field(
        default=None, description="Name clients use; defaults to the model folder's name."
    )
    models: str = Field(
        default="",
        description="API: models served even while no worker runs them (comma-separated names; "
        "their jobs queue until a worker starts). Models with a live worker are served anyway.",
    )
    model_registry_ttl_seconds: float = Field(
        default=1.0, ge=0, description="How long an API process reuses its read of the worker registry."
    )
    api_tokenizer_cache_size: int = Field(
        default=4,
        ge=1,
        description="Tokenizers (each with its template sandbox) one API process keeps loaded for "
        "prompt counting, the least recently used dropped first.",
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        default="auto", description="auto: float32 on CPU, the model's own dtype on GPU."
    )
    max_model_len: int | None = Field(default=None, ge=16)
    max_num_seqs: int = Field(default=64, ge=1)
    kv_cache_space_gib: float = Field(
        default=2.0, gt=0, description="KV cache size on the CPU engine (VLLM_CPU_KVCACHE_SPACE)."
    )
    kv_cache_blocks: int | None = Field(
        default=None,
        ge=1,
        description="Fix the KV cache at this many blocks (vLLM's num_gpu_blocks_override; 128 "
        "tokens a block on CPU) instead of sizing it from memory: a small cache for benchmarks.",
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
    quiet_stream_interval: int = Field(
        default=16,
        ge=1,
        description="Tokens per engine update (vLLM's stream_interval) for a job not submitted "
        "with stream: true, until a client streams it; the first and last come at once. 1: every "
        "token.",
    )

    # Request bounds, enforced before anything is queued.
    max_n: int = Field(default=8, ge=1)
    max_tokens_limit: int = Field(default=4096, ge=1)
    max_messages: int = Field(default=1000, ge=1)
    max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    max_json_depth: int = Field(default=64, ge=4)
    max_request_bytes: int = Field(
        default=2 * 1024 * 1024,
        ge=1024,
        description="A job's request (stored JSON) over this fails alone in the worker (400, "
        "`request_too_large`) before it is parsed or rendered.",
    )
    max_stop_sequences: int = 4

    # Structured outputs: what a constraint may cost, checked before anything is queued,
    # and the sandbox processes that compile each one (see app/services/sandbox.py).
    max_schema_bytes: int = Field(
        default=64 * 1024, ge=256, description="Bytes of one JSON schema or `guided_grammar`."
    )
    max_schema_refs: int = Field(default=256, ge=1, description="`$ref`s in one JSON schema.")
    max_schema_ref_depth: int = Field(
        default=64, ge=1, description="Longest chain of `$ref`s followed one inside another."
    )
    max_grammar_rules: int = Field(default=1000, ge=1, description="Rules in one `guided_grammar`.")
    max_regex_length: int = Field(
        default=4096, ge=16, description="Characters of `guided_regex` or one schema `pattern`."
    )
    max_choices: int = Field(default=1000, ge=1, description="Entries of `guided_choice`.")
    max_choice_bytes: int = Field(default=4096, ge=1, description="Bytes of one `guided_choice` entry.")
    constraint_sandbox_processes: int = Field(
        default=2, ge=1, description="Sandbox processes per API/worker process that compile constraints."
    )
    constraint_compile_timeout_seconds: float = Field(
        default=5.0, gt=0, description="Time one constraint may take to compile in the sandbox."
    )
    constraint_compile_memory_mib: int = Field(
        default=1024, ge=64, description="Address space a sandbox compile may add (RLIMIT_AS)."
    )
    constraint_cache_size: int = Field(
        default=4096, ge=1, description="Compile verdicts cached per process, by (backend, constraint)."
    )

    # Batches.
    max_upload_bytes: int = Field(default=200 * 1024 * 1024, ge=1024)
    max_line_bytes: int = Field(
        default=32 * 1024 * 1024, ge=1024, description="A batch input line over this refuses the upload."
    )
    max_batch_lines: int = Field(default=50_000, ge=1)
    batch_chunk_size: int = Field(
        default=32,
        ge=1,
        description="Most batch lines per broker message (smaller when the model's workers are small: "
        "see app/services/dispatch.py).",
    )
    batch_dispatch_headroom: float = Field(
        default=1.5,
        ge=1,
        description="Batch lines out per model = this x the live workers' capacity, so each worker has "
        "its next lines at hand.",
    )
    batch_cold_window: int = Field(
        default=256,
        ge=1,
        description="Batch lines sent for a model with no live worker (scale from zero): a starting "
        "worker finds them at once.",
    )
    batch_dispatch_window: int | None = Field(
        default=None, ge=1, description="Optional ceiling on batch lines out per model; unset: none."
    )
    batch_tick_seconds: float = Field(default=0.2, gt=0, description="How often the batch feeder runs.")
    batch_idle_tick_seconds: float = Field(
        default=1.0,
        gt=0,
        description="How often the batch feeder looks while no batch is active (a new one wakes it at once).",
    )

    # Templates and tools.
    allow_custom_chat_template: bool = Field(
        default=False,
        description="Render user `chat_template`s (in a sandbox process) instead of refusing them.",
    )
    max_chat_template_bytes: int = Field(default=64 * 1024, ge=1)
    chat_template_timeout_seconds: float = Field(
        default=2.0,
        gt=0,
        description="Time limit of a render with user input in the template (a user `chat_template`, "
        "or `chat_template_kwargs`, or a large request), in a sandbox process.",
    )
    max_chat_template_kwargs_bytes: int = Field(
        default=16 * 1024, ge=2, description="Size limit of `chat_template_kwargs` as JSON."
    )
    template_sandbox_processes: int = Field(
        default=2,
        ge=1,
        description="Sandbox render processes per API or worker process (started on first use).",
    )
    inprocess_render_max_bytes: int = Field(
        default=64 * 1024,
        ge=0,
        description="In the API, requests (messages, tools, documents) up to this size with the "
        "model's own template and no `chat_template_kwargs` render in-process; larger ones in the "
        "sandbox (the worker renders those in-process up to LLMQ_MAX_REQUEST_BYTES).",
    )
    tool_call_parser: str | None = Field(
        default=None,
        description="vLLM tool parser for `tool_choice: auto` (e.g. hermes); unset refuses auto.",
    )
    image_url_resolve_timeout_seconds: float = Field(
        default=2.0,
        gt=0,
        description="How long an `image_url` host name may take to resolve before it is refused.",
    )
    api_counts_prompt_tokens: bool = Field(
        default=True,
        description="Count prompt tokens in the API (400 before queuing) when the model is local.",
    )

    auth_cache_seconds: float = Field(
        default=10.0,
        ge=0,
        description=(
            "How long an API process may reuse a key's lookup; revoking a key or changing a "
            "tenant's priority band through llmq is seen at once; 0 looks every request up."
        ),
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
    max_active_batch_lines_per_tenant: int = Field(
        default=100_000,
        ge=0,
        description="Unfinished batch lines per tenant, checked at batch creation; 0: no cap.",
    )
    batch_token_budget: int = Field(
        default=0,
        ge=0,
        description="Tokens a tenant may have enqueued per model in unfinished batches (prompt + "
        "max_tokens per line), checked at batch creation; a tenant's own (`llmq tenants set "
        "--batch-token-budget`) wins; 0: no limit.",
    )
    max_streams_per_key: int = Field(
        default=32, ge=0, description="SSE streams and file downloads open at once per key; 0: no cap."
    )
    idempotency_ttl_seconds: int = Field(
        default=24 * 3600, ge=60, description="How long an Idempotency-Key holds."
    )

    # Auth.
    auth_failures_per_minute: int = Field(
        default=60,
        ge=0,
        description="Failed authentications (no, unknown or revoked key) per client address per "
        "minute before 429s; 0 turns it off. A correct key is never refused by it.",
    )
    auth_failure_burst: int = Field(default=30, ge=1, description="Failed authentications allowed at once.")
    trusted_proxy_hops: int = Field(
        default=0,
        ge=0,
        description="Reverse proxies in front of the API whose X-Forwarded-For is trusted: the client "
        "address is that many entries from the right; 0 ignores the header (the peer address).",
    )
    health_details: Literal["public", "authenticated", "none"] = Field(
        default="authenticated",
        description="Who sees worker names (host names, pids) and per-worker series on /readyz and "
        "/metrics: everyone, callers with a valid API key, or no one. Readiness and per-model "
        "counts are always public.",
    )
    bootstrap_api_key: str | None = Field(
        default=None,
        description="Registered for the default tenant by `llmq migrate` (the release step) and `llmq up`.",
    )
    default_tenant: str = "default"

    # Reliability.
    lease_seconds: float = Field(default=30.0, gt=0)
    sweeper_interval_seconds: float = Field(default=5.0, gt=0)
    expiry_interval_seconds: float = Field(
        default=60.0, gt=0, description="How often a worker deletes files past their `expires_at`."
    )
    expiry_chunk_rows: int = Field(
        default=1000, ge=1, description="Rows the file expiry deletes or clears per transaction."
    )
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
    results_poll_seconds: float = Field(
        default=1.0,
        gt=0,
        description="How often a followed `/v1/batches/<id>/results` asks Postgres for newly ended lines.",
    )
    db_pool_size: int = Field(default=10, ge=1, description="Pooled Postgres connections per API process.")
    worker_db_pool_size: int = Field(default=8, ge=1, description="Pooled Postgres connections per worker.")
    db_max_overflow: int = Field(
        default=4, ge=0, description="Connections an API or worker process may open past its pool under load."
    )
    database_pooler: Literal["none", "pgbouncer"] = Field(
        default="none",
        description="`pgbouncer`: LLMQ_DATABASE_URL is a pooler in transaction mode; no server-side "
        "prepared statements are made.",
    )
    db_pool_timeout_seconds: float = Field(
        default=10.0, gt=0, description="How long a request waits for a pooled connection before a 503."
    )
    worker_heartbeat_seconds: float = Field(default=5.0, gt=0)
    worker_presence_ttl_seconds: float = Field(
        default=5.0,
        gt=0,
        description="A worker refreshes its presence five times within this; once it lapses "
        "(the worker died), its running jobs are re-queued without waiting for their leases.",
    )
    shutdown_grace_seconds: float = Field(
        default=20.0, ge=0, description="On SIGTERM, how long running jobs may finish."
    )

    # Webhooks (see docs/API.md, "Webhooks").
    webhook_allow_private: bool = Field(
        default=False,
        description="Let webhook endpoints point at loopback, private and link-local addresses "
        "(receivers inside your own network); refused otherwise, at creation and at every attempt.",
    )
    # Object storage for batch inputs and outputs (app/services/object_store.py). The store
    # itself is configured the way boto3 is: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
    # AWS_REGION, and AWS_ENDPOINT_URL_S3 for an S3-compatible store that is not AWS.
    s3_buckets: str = Field(
        default="",
        description="The buckets each tenant may read and write: `tenant=bucket[,bucket];tenant=...`, "
        "tenant `*` for every tenant; empty: no s3:// path is allowed.",
    )
    s3_part_bytes: int = Field(
        default=8 * 1024 * 1024,
        ge=5 * 1024 * 1024,
        description="Size of each part of a multipart upload of a batch's output (S3's minimum is 5 MiB); "
        "the most memory one export holds.",
    )
    s3_export_poll_seconds: float = Field(
        default=1.0, gt=0, description="Worker: how often ended batches are looked for to export."
    )
    webhook_max_endpoints_per_tenant: int = Field(
        default=16, ge=1, description="Webhook endpoints per tenant."
    )
    webhook_connect_timeout_seconds: float = Field(
        default=5.0, gt=0, description="Time a webhook attempt may take to connect."
    )
    webhook_timeout_seconds: float = Field(
        default=10.0, gt=0, description="Time a webhook receiver may take to answer (each read or write)."
    )
    webhook_concurrency: int = Field(
        default=8, ge=1, description="Webhook attempts in flight at once per worker process."
    )
    webhook_poll_seconds: float = Field(
        default=1.0, gt=0, description="How often each worker looks for webhook deliveries that are due."
    )
    webhook_retry_base_seconds: float = Field(
        default=5.0, gt=0, description="Wait after a webhook's first failed attempt; it doubles after each."
    )
    webhook_retry_cap_seconds: float = Field(
        default=120.0, gt=0, description="Longest wait between attempts in an event's first hour."
    )
    webhook_retry_late_cap_seconds: float = Field(
        default=3600.0, gt=0, description="Longest wait between attempts after an event's first hour."
    )
    webhook_retry_lifetime_seconds: float = Field(
        default=3 * 86400.0,
        gt=0,
        description="How long an event is retried before its delivery is marked failed.",
    )

    # Metrics (app/metrics.py, worker/metrics.py).
    metrics_port: int = Field(
        default=0,
        ge=0,
        le=65535,
        description="A worker's /metrics port; 0 (the default): a free port the system picks, so "
        "several workers share a host; the port is in the worker's heartbeat and on /readyz.",
    )
    metrics_address: str = Field(default="0.0.0.0", description="Where a worker's /metrics port listens.")
    metrics_lease_seconds: float = Field(
        default=60.0,
        gt=0,
        description="The API replica that reports cluster figures on /metrics holds a lease this long, "
        "renewed by each scrape: keep it above Prometheus's scrape interval.",
    )
    metrics_replica_id: str | None = Field(
        default=None,
        description="This API replica's name in the cluster-figures lease; default: host name and "
        "PROMETHEUS_MULTIPROC_DIR (or pid).",
    )

    # Logging and tracing.
    log_level: str = "INFO"
    log_json: bool = False
    otel: bool = Field(
        default=False,
        description="OpenTelemetry traces (needs the `otel` extra); exporters from the OTEL_* variables.",
    )

    # `llmq up`, `llmq api` and the CLI client.
    port: int = Field(
        default=8000,
        validation_alias=AliasChoices("LLMQ_PORT", "PORT", "port"),
        description="`llmq api`'s port; PORT is what Procfile platforms set.",
    )
    api_workers: int = Field(
        default=2, ge=1, description="gunicorn worker processes per API (`llmq api`, `llmq up`)."
    )
    api_graceful_seconds: int = Field(
        default=3,
        ge=1,
        description="On SIGTERM, how long an API process lets open requests (downloads, streams, "
        "waits) finish; keep it under the platform's kill window. A cut stream resumes with Last-Event-ID.",
    )
    embedded_pg_port: int = Field(default=54329, description="First port tried for the embedded Postgres.")
    embedded_redis_port: int = Field(default=56379, description="First port tried for the embedded Redis.")
    embedded_pg_os_user: str = Field(
        default="nobody", description="As root, the embedded Postgres runs as this OS user."
    )
    url: str | None = Field(default=None, description="CLI client: the API's base URL.")
    api_key: str | None = Field(default=None, description="CLI client: the key it sends.")

    @property
    def model_name(self) -> str:
        """The name clients put in `model`."""
        if self.served_model_name:
            return self.served_model_name
        if self.model:
            return Path(self.model.rstrip("/")).name or self.model
        return "unconfigured"

    @property
    def declared_models(self) -> list[str]:
        """The names in `LLMQ_MODELS`, in order, without repeats."""
        return list(dict.fromkeys(n.strip() for n in self.models.split(",") if n.strip()))

    @property
    def inflight_limit(self) -> int:
        """How many jobs one worker runs at once (vLLM's own figure is about 2x seqs)."""
        return self.max_inflight or 2 * self.max_num_seqs

    @property
    def webhook_schedule(self) -> RetrySchedule:
        return RetrySchedule(
            base=self.webhook_retry_base_seconds,
            cap=self.webhook_retry_cap_seconds,
            late_cap=self.webhook_retry_late_cap_seconds,
            lifetime=self.webhook_retry_lifetime_seconds,
        )

    def require_database_url(self) -> str:
        if not self.database_url:
            raise RuntimeError("LLMQ_DATABASE_URL is not set (use `llmq up` for embedded stores)")
        return self.database_url

    def require_redis_url(self) -> str:
        if not self.redis_url:
            raise RuntimeError("LLMQ_REDIS_URL is not set (use `llmq up` for embedded stores)")
        return self.redis_url


# `LLMQ_` names read by something other than Settings: the test suite's and fuzzer's knobs.
NOT_SETTINGS_PREFIXES = ("LLMQ_TEST_", "LLMQ_FUZZ_")


def unknown_environment(environ: Mapping[str, str]) -> list[str]:
    """`LLMQ_` variables that name no setting: most likely a typo, silently ignored
    otherwise (pydantic-settings drops unknown names)."""
    known = {f"LLMQ_{name.upper()}" for name in Settings.model_fields}
    return sorted(
        name
        for name in environ
        if name.startswith("LLMQ_") and name not in known and not name.startswith(NOT_SETTINGS_PREFIXES)
    )
