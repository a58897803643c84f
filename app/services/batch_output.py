"""A batch's output and error files, rendered from its job rows (OpenAI's
`BatchRequestOutput` lines, one per job, in input order), and the same output as llm-engine
writes it (one JSON array) for exports to object storage."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from sqlalchemy import Connection, select

from app.db import Database
from app.domain.status import JobStatus
from app.errors import error_body, error_object, line_error
from app.models import Job
from app.services.batch_transitions import LINE_ERRORS

DOWNLOAD_PAGE_ROWS = 1000


ENDED = [
    JobStatus.SUCCEEDED.value,
    JobStatus.FAILED.value,
    JobStatus.CANCELLED.value,
    JobStatus.EXPIRED.value,
]


def part_statuses(part: str) -> list[str]:
    """The statuses of the lines in a batch's output file (`part` "output") or error file."""
    if part == "output":
        return [JobStatus.SUCCEEDED.value]
    return [JobStatus.FAILED.value, JobStatus.CANCELLED.value, JobStatus.EXPIRED.value]


def line_rows(
    db: Database,
    batch_id: str,
    statuses: list[str],
    *,
    page: int = DOWNLOAD_PAGE_ROWS,
    first_on: Connection | None = None,
) -> Iterator[Any]:
    """The batch's job rows in `statuses`, in input order: (line_no, id, custom_id, status,
    response, error). Read in pages of `page` rows, each its own short query (keyset on the
    line number), so a slow reader holds no pooled connection between pages. `first_on`: a
    connection the caller holds, for the first page only (`Database.page`)."""
    after = -1
    while True:
        q = (
            select(Job.line_no, Job.id, Job.custom_id, Job.status, Job.response, Job.error)
            .where(Job.batch_id == batch_id, Job.status.in_(statuses), Job.line_no > after)
            .order_by(Job.line_no)
            .limit(page)
        )
        with db.page(first=after == -1, on=first_on) as conn:
            rows = conn.execute(q).all()
        yield from rows
        if len(rows) < page:
            return
        after = rows[-1].line_no


def output_lines(
    db: Database,
    batch_id: str,
    part: str,
    *,
    page: int = DOWNLOAD_PAGE_ROWS,
    first_on: Connection | None = None,
) -> Iterator[bytes]:
    """The batch's output (`part` "output": succeeded lines) or error file ("errors": the
    rest), generated from its job rows in input order; "all": every ended line. `first_on`:
    as for `line_rows`."""
    statuses = ENDED if part == "all" else part_statuses(part)
    for row in line_rows(db, batch_id, statuses, page=page, first_on=first_on):
        yield (json.dumps(output_line(*row[1:]), ensure_ascii=False) + "\n").encode("utf-8")


def engine_items(db: Database, batch_id: str, *, page: int = DOWNLOAD_PAGE_ROWS) -> Iterator[bytes]:
    """llm-engine's batch output: one JSON array, an item per line in input order
    (`engine_item`), generated a line at a time."""
    yield b"["
    for number, row in enumerate(line_rows(db, batch_id, ENDED, page=page)):
        item = json.dumps(engine_item(row.status, row.response, row.error), ensure_ascii=False)
        yield (("," if number else "") + item).encode("utf-8")
    yield b"]"


def engine_item(status: str, response: Any, error: Any) -> Any:
    """A succeeded line's completion; an error object (`{message, type, param, code}`) where
    the line failed, was cancelled or expired; null where no result is kept (its text has
    expired, app/services/expiry.py), as llm-engine writes null for a request without one."""
    if status == JobStatus.SUCCEEDED.value:
        return response or None
    if status in LINE_ERRORS:
        code, message = LINE_ERRORS[status]
        return error_object(message, "invalid_request_error", code=code)
    body = error or error_body("the request failed", "api_error")
    return body.get("error")


def output_line(job_id: str, custom_id: str, status: str, response: Any, error: Any) -> dict[str, Any]:
    """One `BatchOutputLine` (app/schemas/batches.py) as its `model_dump()` reads: a
    succeeded job's completion, a failed job's error body (as the HTTP response it would
    have been), or an ended line's `{code, message}`. A line whose text has expired
    (app/services/expiry.py) keeps its place with an empty body. Built as plain data, not
    through the model: validating and dumping each line was a quarter of rendering an
    output, which a batch's finalize does to measure its files, and each download again."""
    line_id = "batch_req_" + job_id.removeprefix("job_")
    if status == JobStatus.SUCCEEDED.value:
        answer = {"status_code": 200, "request_id": job_id, "body": response or {}}
        return {"id": line_id, "custom_id": custom_id, "response": answer, "error": None}
    if status in LINE_ERRORS:
        return {
            "id": line_id,
            "custom_id": custom_id,
            "response": None,
            "error": line_error(*LINE_ERRORS[status]),
        }
    body = error or error_body("the request failed", "api_error")
    kind = body.get("error", {}).get("type")
    answer = {
        "status_code": 400 if kind == "invalid_request_error" else 500,
        "request_id": job_id,
        "body": body,
    }
    return {"id": line_id, "custom_id": custom_id, "response": answer, "error": None}
