"""The states a job and a batch pass through, and what they are for: stored as text in
Postgres (`StrEnum`), read by the API, the worker and the sweeper alike."""

from __future__ import annotations

from enum import StrEnum


class JobStatus(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"

    @property
    def terminal(self) -> bool:
        return self not in (JobStatus.QUEUED, JobStatus.RUNNING)


class JobKind(StrEnum):
    CHAT = "chat"
    BENCH = "bench"
    # A text completion (`POST /v1/completions`, Scale's `/v1/llm/completions-*`): the
    # request is app/schemas/text_completion.py's `CompletionRequest`, no chat template.
    COMPLETION = "completion"


class FilePurpose(StrEnum):
    BATCH = "batch"
    BATCH_OUTPUT = "batch_output"


class BatchStatus(StrEnum):
    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"
