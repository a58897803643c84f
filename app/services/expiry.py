"""File expiry (OpenAI's `expires_after` on uploads, `output_expires_after` on batches): a
file past its `expires_at` is deleted, and it answers 404 from then on, as OpenAI's do.

- An uploaded input file loses its lines, then its row. One still being read by a batch
  that is `validating` waits for the next round (the lines become jobs from it).
- A batch's output or error file is generated from job rows, so its lines' stored texts go
  with it: the request, the response and the recorded stream of each line in that file
  are cleared. What the batch reports stays: each line's status, usage and error code, so
  the batch's `request_counts` and `usage` are unchanged.

Run by one worker at a time (worker/expiry.py). Each step is a short transaction over at
most `chunk` rows, walking the lines in order, so a 50,000-line batch never holds a long
lock; a crash midway leaves work that the next round simply does again."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, cast

from sqlalchemy import text

from app.db import Database
from app.services.batch_output import part_statuses

log = logging.getLogger("llmq.expiry")

_DUE = text(
    """
    SELECT f.id, f.batch_id, f.batch_part FROM files f
    WHERE f.expires_at IS NOT NULL AND f.expires_at <= :now
      AND NOT EXISTS (SELECT 1 FROM batches b WHERE b.status = 'validating' AND b.input_file_id = f.id)
    ORDER BY f.expires_at LIMIT :n
    """
)
_CLEAR_LINES = text(
    """
    UPDATE jobs SET request = '{}'::json, response = NULL, events = NULL
    WHERE id IN (SELECT id FROM jobs WHERE batch_id = :batch AND status = ANY(:statuses)
                 AND line_no > :after ORDER BY line_no LIMIT :n)
    RETURNING line_no
    """
)
_DELETE_INPUT_LINES = text(
    """
    DELETE FROM file_lines WHERE file_id = :file AND line_no IN
        (SELECT line_no FROM file_lines WHERE file_id = :file ORDER BY line_no LIMIT :n)
    """
)


@dataclass
class ExpiryReport:
    files: int = 0
    lines_cleared: int = 0
    input_lines_deleted: int = 0


class FileExpiry:
    def __init__(self, db: Database, *, chunk: int = 1000, files_per_round: int = 100) -> None:
        self._db = db
        self._chunk = chunk
        self._files = files_per_round

    def expire_due(self, now: datetime | None = None) -> ExpiryReport:
        """Delete up to `files_per_round` files whose `expires_at` has passed."""
        report = ExpiryReport()
        with self._db.session() as s:
            due = s.execute(_DUE, {"now": now or datetime.now(UTC), "n": self._files}).all()
        for row in due:
            if row.batch_id is not None and row.batch_part is not None:
                report.lines_cleared += self._clear_lines(row.batch_id, row.batch_part)
            else:
                report.input_lines_deleted += self._delete_input_lines(row.id)
            with self._db.session() as s:
                s.execute(text("DELETE FROM files WHERE id = :f"), {"f": row.id})
            report.files += 1
            log.info("file expired", extra={"file_id": row.id, "batch_id": row.batch_id})
        return report

    def _clear_lines(self, batch_id: str, part: str) -> int:
        cleared, after = 0, -1
        while True:
            with self._db.session() as s:
                done = [
                    r.line_no
                    for r in s.execute(
                        _CLEAR_LINES,
                        {
                            "batch": batch_id,
                            "statuses": part_statuses(part),
                            "after": after,
                            "n": self._chunk,
                        },
                    )
                ]
            cleared += len(done)
            if len(done) < self._chunk:
                return cleared
            after = max(done)

    def _delete_input_lines(self, file_id: str) -> int:
        deleted = 0
        while True:
            with self._db.session() as s:
                n = int(
                    cast(Any, s.execute(_DELETE_INPUT_LINES, {"file": file_id, "n": self._chunk})).rowcount
                )
            deleted += n
            if n < self._chunk:
                return deleted
