"""`GET /v2/throughput`: a tenant's finished jobs and tokens per time bucket."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from app.schemas.base import WireModel


class ThroughputBucket(WireModel):
    """The jobs that ended in `[start, start + bucket_seconds)` and the tokens they used."""

    start: int = Field(description="Unix seconds; a multiple of `bucket_seconds`.")
    succeeded: int
    failed: int
    cancelled: int
    expired: int
    prompt_tokens: int
    completion_tokens: int
    output_tokens_per_second: float = Field(
        description="`completion_tokens` over the bucket's length (the current bucket: over the "
        "part of it that has passed)."
    )


class Throughput(WireModel):
    object: Literal["throughput"] = "throughput"
    start: int = Field(description="Unix seconds: the first bucket's start.")
    end: int = Field(description="Unix seconds: when the figures were read.")
    bucket_seconds: int
    data: list[ThroughputBucket] = Field(description="Every bucket of the window, oldest first.")
