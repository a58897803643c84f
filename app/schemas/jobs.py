"""The job object and its list page."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from app.domain.status import JobStatus
from app.schemas.base import WireModel


class ErrorBody(WireModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(WireModel):
    """The one error shape, everywhere. A refused upload adds OpenAI's `errors` list:
    `{"object": "list", "data": [{code, message, param, line}]}`."""

    error: ErrorBody
    errors: dict[str, Any] | None = None


class JobObject(WireModel):
    id: str
    object: Literal["job"] = "job"
    status: JobStatus
    model: str
    priority: int
    attempts: int
    epoch: int
    lease_owner: str | None = None
    finished_by: str | None = None
    created_at: int
    started_at: int | None = None
    succeeded_at: int | None = None
    failed_at: int | None = None
    cancelled_at: int | None = None
    expired_at: int | None = None
    cancel_requested_at: int | None = None
    batch_id: str | None = None
    custom_id: str | None = None
    response: dict[str, Any] | None = None
    error: ErrorBody | None = None
    usage: dict[str, Any] | None = None
    generation_stats: dict[str, Any] | None = None
    power_usage: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    # The X-Request-ID of the request that created the job (a batch line: its batch's).
    request_id: str | None = None
    queue_wait_seconds: float | None = Field(
        default=None, description="Seconds from the job's creation to its first claim by a worker."
    )
    ttft_seconds: float | None = Field(
        default=None,
        description="Seconds from the job's submission to the engine to its first token; null without one.",
    )
    e2e_seconds: float | None = Field(default=None, description="Seconds from the job's creation to its end.")


class JobList(WireModel):
    object: Literal["list"] = "list"
    data: list[JobObject]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool


class ModelCard(WireModel):
    """OpenAI's model object, with what a client of a queue needs to know besides."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "llmq"
    max_model_len: int | None = Field(
        default=None, description="Context length in tokens; null while no worker has reported it."
    )
    live: bool = Field(description="A worker serving this model is consuming now.")
    workers: int = Field(description="Live workers serving this model.")
    declared: bool = Field(
        description="Served even with no live worker (LLMQ_MODELS): its jobs wait for a worker."
    )


class ModelList(WireModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
