"""Ended batches' outputs written to object storage, by the workers.

A batch with an `output_url` is exported once it has ended (completed, cancelled or
expired): every line in input order, as OpenAI output lines (JSONL) or as llm-engine's one
JSON array, generated from its job rows a page at a time and sent as a multipart upload,
so memory holds one part whatever the output's size. A worker claims one batch at a time
with a lease (FOR UPDATE SKIP LOCKED), so workers share the exports and one that dies
mid-upload leaves the batch to the next once its lease runs out; an upload is aborted on
error and the object only appears whole. A store that cannot be reached is tried again
after RETRY_SECONDS; a refusal (access denied, no such bucket) is final and recorded on the
batch (`export_error`).

Runs on its own thread in every worker (worker/runtime.py), never in the API, and never
in the batch scheduler's tick, so a long upload holds back no batch's lines.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import text, update

from app.db import Database
from app.errors import LlmqError, ServiceUnavailable, error_object
from app.models import Batch
from app.services.batch_output import engine_items, output_lines
from app.services.batches import OutputFormat
from app.services.object_store import ObjectStore, parse_path

log = logging.getLogger("llmq.exports")

RETRY_SECONDS = 30.0

_CLAIM = text(
    """
    UPDATE batches SET export_lease_until = now() + make_interval(secs => :lease)
    WHERE id = (
      SELECT id FROM batches
      WHERE output_url IS NOT NULL AND exported_at IS NULL AND export_error IS NULL
        AND status IN ('completed', 'cancelled', 'expired')
        AND (export_lease_until IS NULL OR export_lease_until < now())
      ORDER BY id LIMIT 1 FOR UPDATE SKIP LOCKED)
    RETURNING id, output_url, output_format
    """
)


class BatchExports:
    def __init__(self, db: Database, store: ObjectStore, *, lease_seconds: float = 900.0) -> None:
        """`lease_seconds`: how long one export may take before another worker may redo it."""
        self._db = db
        self._store = store
        self._lease = lease_seconds

    def export_due(self) -> int:
        """Export every ended batch waiting for it; returns how many were written."""
        written = 0
        while (claimed := self._claim()) is not None:
            written += self._export(*claimed)
        return written

    def _claim(self) -> tuple[str, str, str] | None:
        with self._db.session() as s:
            row = s.execute(_CLAIM, {"lease": self._lease}).first()
        return (row.id, row.output_url, row.output_format) if row is not None else None

    def _body(self, batch_id: str, output_format: str) -> Iterator[bytes]:
        if output_format == OutputFormat.JSON_ARRAY.value:
            return engine_items(self._db, batch_id)
        return output_lines(self._db, batch_id, "all")

    def _export(self, batch_id: str, url: str, output_format: str) -> int:
        values: dict[str, Any]
        try:
            path = parse_path(url, param="output_data_path")
            with self._store.writer(path, param="output_data_path") as out:
                out.write_all(self._body(batch_id, output_format))
        except ServiceUnavailable as exc:
            log.warning(
                "batch output not exported; will retry", extra={"batch_id": batch_id, "error": exc.message}
            )
            values = {"export_lease_until": datetime.now(UTC) + timedelta(seconds=RETRY_SECONDS)}
            written = 0
        except LlmqError as exc:
            log.error("batch output not exported", extra={"batch_id": batch_id, "error": exc.message})
            values = {
                "export_error": error_object(exc.message, exc.type, param=exc.param, code=exc.code),
                "export_lease_until": None,
            }
            written = 0
        else:
            log.info(
                "batch output exported",
                extra={"batch_id": batch_id, "bytes": out.bytes_written, "format": output_format},
            )
            values = {"exported_at": datetime.now(UTC), "export_lease_until": None}
            written = 1
        with self._db.session() as s:
            s.execute(update(Batch).where(Batch.id == batch_id).values(**values))
        return written
