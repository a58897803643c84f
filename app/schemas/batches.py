"""OpenAI Files and Batches shapes, and the JSONL lines going in and out."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from app.domain.line_order import LineOrder
from app.domain.metadata import JSON_SCHEMA as METADATA_SCHEMA
from app.schemas.base import WireModel
from app.schemas.chat import ChatCompletionV2Request
from app.schemas.text_completion import CompletionRequest

TEXT_COMPLETIONS_URL = "/v1/completions"
BATCH_ENDPOINTS = ("/v1/chat/completions", "/v2/chat/completions", TEXT_COMPLETIONS_URL)


class BatchInputLine(WireModel):
    """One line of an input file."""

    custom_id: str = Field(min_length=1, max_length=512)
    method: Literal["POST"]
    url: str
    body: ChatCompletionV2Request


class TextBatchInputLine(WireModel):
    """One line of an input file for `/v1/completions`: its body is a text completion."""

    custom_id: str = Field(min_length=1, max_length=512)
    method: Literal["POST"]
    url: Literal["/v1/completions"]
    body: CompletionRequest


# An object storage path (app/services/object_store.py): s3://, a bucket name, a key.
OBJECT_PATH_PATTERN = r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]/[^\x00]+$"

MIN_EXPIRY_SECONDS = 3600
MAX_EXPIRY_SECONDS = 30 * 24 * 3600


class ExpiresAfter(WireModel):
    """OpenAI's file expiration policy (`expires_after` on an upload, `output_expires_after`
    on a batch, where the anchor is the output file's creation)."""

    anchor: Literal["created_at"]
    seconds: int = Field(ge=MIN_EXPIRY_SECONDS, le=MAX_EXPIRY_SECONDS)


class FileUploadOptions(WireModel):
    """The multipart form's fields beside `file` and `purpose`."""

    expires_after: ExpiresAfter | None = None


class FileObject(WireModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: Literal["processed"] = "processed"
    status_details: str | None = None
    expires_at: int | None = None


class FileList(WireModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class FileDeleted(WireModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool


class BatchLineError(WireModel):
    """OpenAI's `BatchError`: what is wrong, and on which line."""

    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchErrors(WireModel):
    object: Literal["list"] = "list"
    data: list[BatchLineError]


# A whole number of minutes, hours or days from 1 hour to 7 days: 60m..10080m, 1h..168h, 1d..7d.
COMPLETION_WINDOW_PATTERN = (
    r"^(?:(?:[6-9][0-9]|[1-9][0-9]{2,3}|100[0-7][0-9]|10080)m"
    r"|(?:[1-9]|[1-9][0-9]|1[0-5][0-9]|16[0-8])h|[1-7]d)$"
)


class BatchCreate(WireModel):
    input_file_id: str = Field(
        min_length=1,
        max_length=1100,
        pattern=r"^[^\x00]+$",
        description="An uploaded file's id, or an `s3://bucket/key` JSONL object in a bucket this "
        "tenant may use (read into a new input file when the batch is created).",
    )
    endpoint: str = Field(json_schema_extra={"enum": list(BATCH_ENDPOINTS)})
    # From 1h to 7d; checked (with a message naming the range) by the service.
    completion_window: str = Field(max_length=16, json_schema_extra={"pattern": COMPLETION_WINDOW_PATTERN})
    metadata: dict[str, str] | None = Field(default=None, json_schema_extra=METADATA_SCHEMA)
    output_expires_after: ExpiresAfter | None = None
    # llmq's extension.
    x_output_data_path: str | None = Field(
        default=None,
        max_length=1100,
        json_schema_extra={"pattern": OBJECT_PATH_PATTERN},
        description="An `s3://bucket/key` the batch's output is written to when it ends: every line "
        "in input order, as output file lines (JSONL).",
    )
    # llmq's extension: "prefix" (default) runs lines sharing a prompt prefix together;
    # "input" sends them in file order (app/domain/line_order.py).
    x_line_order: LineOrder = LineOrder.PREFIX


class RequestCounts(WireModel):
    total: int
    completed: int
    failed: int


class InputTokensDetails(WireModel):
    cached_tokens: int = 0


class OutputTokensDetails(WireModel):
    reasoning_tokens: int = 0


class BatchUsage(WireModel):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens_details: OutputTokensDetails


class BatchProgress(WireModel):
    queued: int = 0
    running: int = 0
    succeeded: int = 0
    failed: int = 0
    cancelled: int = 0
    expired: int = 0


class BatchObject(WireModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str = Field(json_schema_extra={"enum": list(BATCH_ENDPOINTS)})
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: str
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts
    metadata: dict[str, Any] | None = None
    usage: BatchUsage | None = None
    model: str | None = None
    # llmq's extensions.
    x_progress: BatchProgress
    x_output_tokens_per_second: float | None = None
    x_estimated_seconds_left: float | None = None
    x_parent_batch_id: str | None = None
    # The X-Request-ID of the request that created the batch (its lines carry it too).
    x_request_id: str | None = None
    # Object storage: where the input was read from and the output goes, and how its export
    # ended (the time it was written, or the error that stopped it).
    x_input_data_path: str | None = None
    x_output_data_path: str | None = None
    x_output_exported_at: int | None = None
    x_output_export_error: dict[str, Any] | None = None
    x_line_order: LineOrder = LineOrder.PREFIX


class BatchList(WireModel):
    object: Literal["list"] = "list"
    data: list[BatchObject]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class OutputResponse(WireModel):
    status_code: int
    request_id: str
    body: dict[str, Any]


class OutputError(WireModel):
    code: str
    message: str


class BatchOutputLine(WireModel):
    """One line of an output or error file (OpenAI's `BatchRequestOutput`)."""

    id: str
    custom_id: str
    response: OutputResponse | None = None
    error: OutputError | None = None
