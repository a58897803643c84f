"""A batch's output and error files, rendered from its job rows (OpenAI's
`BatchRequestOutput` lines, one per job, in input order)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from sqlalchemy import select

from app.db import Database
from app.domain.status import JobStatus
from app.errors import error_body, line_error
from app.models import Job
from app.schemas.batches import BatchOutputLine, OutputError, OutputResponse
from app.services.batch_transitions import LINE_ERRORS

DOWNLOAD_PAGE_ROWS = 1000


def part_statuses(part: str) -> list[str]:
    """The statuses of the lines in a batch's output file (`part` "output") or error file."""
    if part == "output":
        return [JobStatus.SUCCEEDED.value]
    return [JobStatus.FAILED.value, JobStatus.CANCELLED.value, JobStatus.EXPIRED.value]


def output_lines(
    db: Database, batch_id: str, part: str, *, page: int = DOWNLOAD_PAGE_ROWS
) -> Iterator[bytes]:
    """The batch's output (`part` "output": succeeded lines) or error file ("errors": the
    rest), generated from its job rows in input order. Read in pages of `page` rows, each
    its own short query (keyset on the line number), so a slow reader holds no pooled
    connection between pages."""
    statuses = part_statuses(part)
    after = -1
    while True:
        q = (
            select(Job.line_no, Job.id, Job.custom_id, Job.status, Job.response, Job.error)
            .where(Job.batch_id == batch_id, Job.status.in_(statuses), Job.line_no > after)
            .order_by(Job.line_no)
            .limit(page)
        )
        with db.engine.connect() as conn:
            rows = conn.execute(q).all()
        for row in rows:
            yield (json.dumps(output_line(*row[1:]), ensure_ascii=False) + "\n").encode("utf-8")
        if len(rows) < page:
            return
        after = rows[-1].line_no


def output_line(job_id: str, custom_id: str, status: str, response: Any, error: Any) -> dict[str, Any]:
    """One `BatchOutputLine`: a succeeded job's completion, a failed job's error body (as
    the HTTP response it would have been), or an ended line's `{code, message}`. A line
    whose text has expired (app/services/expiry.py) keeps its place with an empty body."""
    line_id = "batch_req_" + job_id.removeprefix("job_")
    if status == JobStatus.SUCCEEDED.value:
        line = BatchOutputLine(
            id=line_id,
            custom_id=custom_id,
            response=OutputResponse(status_code=200, request_id=job_id, body=response or {}),
        )
    elif status in LINE_ERRORS:
        line = BatchOutputLine(
            id=line_id,
            custom_id=custom_id,
            error=OutputError.model_validate(line_error(*LINE_ERRORS[status])),
        )
    else:
        body = error or error_body("the request failed", "api_error")
        kind = body.get("error", {}).get("type")
        line = BatchOutputLine(
            id=line_id,
            custom_id=custom_id,
            response=OutputResponse(
                status_code=400 if kind == "invalid_request_error" else 500, request_id=job_id, body=body
            ),
        )
    return line.model_dump()
