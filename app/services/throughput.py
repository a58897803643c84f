"""A tenant's throughput over a recent window, from its job records: how many jobs ended
in each time bucket, by status, and the tokens they used.

A job counts in the bucket where it ended (its terminal timestamp), with all its tokens:
a bucket's tokens per second is what the jobs that ended in it generated, over the
bucket's length. Jobs still running are not counted yet. The query is a range scan of
`ix_jobs_tenant_ended` (app/models.py), so its cost follows the window's jobs, not the
tenant's history.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from datetime import UTC, datetime

from sqlalchemy import text

from app.db import Database
from app.errors import InvalidRequest
from app.models import JOB_ENDED_AT, TERMINAL_STATUSES
from app.schemas.throughput import Throughput, ThroughputBucket
from app.services.keys import Principal

MIN_BUCKET_SECONDS = 60
MAX_BUCKET_SECONDS = 3600
MIN_WINDOW_SECONDS = 60
MAX_WINDOW_SECONDS = 24 * 3600  # so at most 1,440 buckets

# Each bucket's ended jobs by status. The WHERE clause names the index's expression and
# predicate word for word, so the planner can use it.
_BUCKETS = text(
    f"""
    SELECT floor(extract(epoch FROM {JOB_ENDED_AT}) / :bucket)::bigint AS slot, status,
           count(*) AS jobs,
           coalesce(sum((usage->>'prompt_tokens')::bigint), 0) AS prompt_tokens,
           coalesce(sum((usage->>'completion_tokens')::bigint), 0) AS completion_tokens
    FROM jobs
    WHERE tenant_id = :tenant AND status IN {TERMINAL_STATUSES}
      AND {JOB_ENDED_AT} >= :start AND {JOB_ENDED_AT} < :end
    GROUP BY 1, 2
    """  # noqa: S608 - constant expressions of app/models.py
)

_STATUSES = ("succeeded", "failed", "cancelled", "expired")


def check_window(window_seconds: int, bucket_seconds: int) -> None:
    """Raises InvalidRequest naming the parameter that is out of bounds."""
    if not MIN_BUCKET_SECONDS <= bucket_seconds <= MAX_BUCKET_SECONDS:
        raise InvalidRequest(
            f"`bucket_seconds` must be between {MIN_BUCKET_SECONDS} and {MAX_BUCKET_SECONDS}",
            param="bucket_seconds",
        )
    if not MIN_WINDOW_SECONDS <= window_seconds <= MAX_WINDOW_SECONDS:
        raise InvalidRequest(
            f"`window_seconds` must be between {MIN_WINDOW_SECONDS} and {MAX_WINDOW_SECONDS}",
            param="window_seconds",
        )


class ThroughputService:
    def __init__(self, db: Database, *, clock: Callable[[], datetime] | None = None) -> None:
        self._db = db
        self._clock = clock or (lambda: datetime.now(UTC))

    def read(
        self, principal: Principal, *, window_seconds: int = 3600, bucket_seconds: int = 60
    ) -> Throughput:
        """The caller's tenant's buckets covering the last `window_seconds` (rounded up to
        whole buckets), the current (partial) bucket last; buckets are aligned to multiples
        of `bucket_seconds`.

        Raises:
            InvalidRequest: the window or the bucket is out of bounds (see `check_window`).
        """
        check_window(window_seconds, bucket_seconds)
        now = self._clock()
        current = math.floor(now.timestamp() / bucket_seconds)
        count = -(-window_seconds // bucket_seconds)
        first = current - count + 1
        start = datetime.fromtimestamp(first * bucket_seconds, UTC)
        end = datetime.fromtimestamp((current + 1) * bucket_seconds, UTC)
        with self._db.session() as s:
            rows = s.execute(
                _BUCKETS,
                {"tenant": principal.tenant_id, "bucket": bucket_seconds, "start": start, "end": end},
            ).all()
        slots: dict[int, dict[str, int]] = {
            slot: dict.fromkeys((*_STATUSES, "prompt_tokens", "completion_tokens"), 0)
            for slot in range(first, current + 1)
        }
        for row in rows:
            if row.slot in slots:
                figures = slots[row.slot]
                figures[row.status] += int(row.jobs)
                figures["prompt_tokens"] += int(row.prompt_tokens)
                figures["completion_tokens"] += int(row.completion_tokens)
        data = []
        for slot, figures in slots.items():
            length = bucket_seconds if slot < current else max(1.0, now.timestamp() - slot * bucket_seconds)
            data.append(
                ThroughputBucket(
                    start=slot * bucket_seconds,
                    output_tokens_per_second=round(figures["completion_tokens"] / length, 3),
                    **figures,
                )
            )
        return Throughput(
            start=first * bucket_seconds, end=int(now.timestamp()), bucket_seconds=bucket_seconds, data=data
        )
