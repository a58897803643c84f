"""llm-engine's v2 batch completions on llmq batches: each item of `content` (or of the
JSON array at `input_data_path`), a chat request (`/v1/chat/completions`) or a text
completion request (`/v1/completions`), becomes one line of an llmq batch, so per-line jobs,
progress, retries, resume, deadlines (`max_runtime_sec`) and metadata (`labels`) are the
batch machinery's own (app/services/batches.py). When the batch ends a worker writes the
output to `output_data_path` as llm-engine does (app/services/batch_export.py).

A job's status, from its batch's:

| batch                                   | job         |
|-----------------------------------------|-------------|
| validating, or in_progress with no line started | queued |
| in_progress, finalizing; ended but output not yet written | running |
| completed, output written               | completed   |
| expired (max_runtime_sec passed), failed, or the output could not be written | failed |
| cancelling, cancelled                   | cancelled   |
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select

from app.db import Database
from app.domain.metadata import check_metadata
from app.domain.status import BatchStatus
from app.errors import Conflict, InvalidRequest, NotFound
from app.models import Batch
from app.schemas.batches import TEXT_COMPLETIONS_URL, BatchObject
from app.schemas.scale_batches import (
    NOTHING_ASKED,
    BatchCompletionsJob,
    CancelBatchCompletionsV2Response,
    CreateBatchCompletionsV2Request,
    GetBatchCompletionV2Response,
)
from app.services.batches import BatchService, BatchSpec, ObjectLinks, OutputFormat
from app.services.contract import model_not_found
from app.services.files import FileService
from app.services.keys import Principal
from app.services.models import ModelRegistry
from app.services.parsing import parse_model

CHAT_ENDPOINT = "/v1/chat/completions"
DEFAULT_RUNTIME_SECONDS = 24 * 3600
# Top-level fields that ask for hardware or tools llmq does not provide.
_HARDWARE = (
    "data_parallelism",
    "tool_config",
    "cpus",
    "gpus",
    "memory",
    "gpu_type",
    "storage",
    "nodes_per_worker",
)


def asked_for(req: CreateBatchCompletionsV2Request) -> list[str]:
    """The fields (as `param` names) that ask for something llmq does not manage: anything
    but null or the default the unchanged client sends (NOTHING_ASKED)."""
    asked = [name for name in _HARDWARE if getattr(req, name) not in NOTHING_ASKED.get(name, (None,))]
    config = req.model_config_.model_dump(exclude={"model"})
    asked += [
        f"model_config.{name}"
        for name, value in config.items()
        if value not in NOTHING_ASKED.get(name, (None,))
    ]
    return asked


def item_kind(item: dict[str, Any], number: int) -> str:
    """The endpoint of one request: chat (it has `messages`) or text completion (`prompt`).

    Raises:
        InvalidRequest: neither.
    """
    if "messages" in item:
        return CHAT_ENDPOINT
    if "prompt" in item:
        return TEXT_COMPLETIONS_URL
    param = f"content[{number - 1}]"
    raise InvalidRequest(
        f"{param} is neither a chat request (`messages`) nor a completion request (`prompt`)",
        param=param,
        code="invalid_line",
    )


class LineMaker:
    """Items to batch input lines: `model` is the batch's, `stream` is off (as llm-engine
    overwrites them), null fields are left out, and the batch's `priority`, when given, is
    every line's. All items must be of one kind (chat or completion)."""

    def __init__(self, model: str, priority: int | None) -> None:
        self._model = model
        self._priority = priority
        self.endpoint: str | None = None

    def __call__(self, number: int, item: dict[str, Any]) -> bytes:
        endpoint = item_kind(item, number)
        if self.endpoint is None:
            self.endpoint = endpoint
        elif endpoint != self.endpoint:
            raise InvalidRequest(
                f"content[{number - 1}] is not of the kind of the first item: all items are chat "
                "requests or all are completion requests",
                param=f"content[{number - 1}]",
                code="mixed_items",
            )
        body = {k: v for k, v in item.items() if v is not None and k != "stream"}
        body["model"] = self._model
        if self._priority is not None:
            body["priority"] = self._priority
        line = {"custom_id": str(number - 1), "method": "POST", "url": endpoint, "body": body}
        return json.dumps(line, ensure_ascii=False).encode("utf-8")


def batch_priority(value: str | None) -> int | None:
    """llm-engine's `priority` is a string; llmq's is an integer (lower runs earlier)."""
    if value is None:
        return None
    try:
        return int(value)
    except ValueError as exc:
        raise InvalidRequest(
            f"priority {value!r} is not an integer (lower runs earlier)", param="priority"
        ) from exc


def job_status(batch: BatchObject) -> str:
    status = batch.status
    if status in (BatchStatus.CANCELLING.value, BatchStatus.CANCELLED.value):
        return "cancelled"
    if status == BatchStatus.FAILED.value or batch.x_output_export_error is not None:
        return "failed"
    if status in (BatchStatus.COMPLETED.value, BatchStatus.EXPIRED.value):
        if batch.x_output_exported_at is None:
            return "running"
        return "completed" if status == BatchStatus.COMPLETED.value else "failed"
    progress = batch.x_progress
    if status == BatchStatus.VALIDATING.value or (
        status == BatchStatus.IN_PROGRESS.value and progress.queued == batch.request_counts.total
    ):
        return "queued"
    return "running"


def _iso(seconds: int | None) -> str | None:
    return datetime.fromtimestamp(seconds, UTC).isoformat() if seconds is not None else None


class ScaleBatchService:
    def __init__(
        self, db: Database, batches: BatchService, files: FileService, models: ModelRegistry
    ) -> None:
        self._db = db
        self._batches = batches
        self._files = files
        self._models = models

    def create(self, principal: Principal, payload: Any) -> BatchCompletionsJob:
        """Raises:
        InvalidRequest: a bad field; a field asking for hardware, a checkpoint or an engine
            setting (named); neither or both of `content` and `input_data_path`; a bad item.
        NotFound: `model_config.model` is not served.
        Forbidden: a path in a bucket this tenant may not use.
        As BatchService.create besides (limits, budgets, priority band).
        """
        req = parse_model(CreateBatchCompletionsV2Request, payload)
        asked = asked_for(req)
        if asked:
            raise InvalidRequest(
                f"{', '.join(asked)}: llmq serves the models its workers run and does not take "
                "hardware, checkpoints or engine settings per batch; send these as null (or their "
                "defaults)",
                param=asked[0],
                code="unsupported_parameter",
            )
        model = req.model_config_.model
        if self._models.get(model) is None:
            error = model_not_found(model, self._models.names())
            error.param = "model_config.model"
            raise error
        check_metadata(req.labels, param="labels")
        priority = batch_priority(req.priority)
        if (req.content is None) == (req.input_data_path is None):
            raise InvalidRequest("send either `content` or `input_data_path`", param="content")
        if isinstance(req.content, dict):
            raise InvalidRequest(
                "content is a v1 request (prompts and sampling settings); v2 takes a list of chat requests",
                param="content",
            )
        objects = self._batches.objects()
        output = objects.resolve(principal.tenant_id, req.output_data_path, param="output_data_path")
        make = LineMaker(model, priority)
        input_url: str | None = None
        if req.content is not None:
            if not req.content:
                raise InvalidRequest("content is empty", param="content")
            stored = self._files.store_lines(principal, _lines(req.content, make), "v2-batch-content.jsonl")
        else:
            assert req.input_data_path is not None
            imported = self._batches.inputs().import_items(
                principal, req.input_data_path, make, param="input_data_path"
            )
            stored, input_url = imported.file, str(imported.path)
        seconds = req.max_runtime_sec or DEFAULT_RUNTIME_SECONDS
        created = self._batches.open_batch(
            principal,
            BatchSpec(
                file_id=stored.id,
                endpoint=make.endpoint or CHAT_ENDPOINT,
                completion_window=f"{seconds}s",
                seconds=seconds,
                metadata=req.labels or None,
                links=ObjectLinks(
                    input_url=input_url,
                    output_url=str(output),
                    output_format=OutputFormat.JSON_ARRAY,
                    client_request={
                        "model_config": payload.get("model_config"),
                        "priority": req.priority,
                    },
                ),
            ),
        )
        return self._job(principal, created.id)

    def get(self, principal: Principal, job_id: str) -> GetBatchCompletionV2Response:
        return GetBatchCompletionV2Response(job=self._job(principal, job_id))

    def cancel(self, principal: Principal, job_id: str) -> CancelBatchCompletionsV2Response:
        """`success`: the job was cancelled now or before; false if it had already ended.

        Raises:
            NotFound: no such job for this tenant.
        """
        self._row(principal, job_id)
        try:
            self._batches.cancel(principal, job_id)
        except Conflict:
            return CancelBatchCompletionsV2Response(success=False)
        return CancelBatchCompletionsV2Response(success=True)

    def _row(self, principal: Principal, job_id: str) -> Batch:
        with self._db.session() as s:
            batch = s.scalar(
                select(Batch).where(
                    Batch.id == job_id,
                    Batch.tenant_id == principal.tenant_id,
                    Batch.output_format == OutputFormat.JSON_ARRAY.value,
                )
            )
        if batch is None:
            raise NotFound(f"no batch completions job {job_id!r}", param="job_id")
        return batch

    def _job(self, principal: Principal, job_id: str) -> BatchCompletionsJob:
        row = self._row(principal, job_id)
        batch = self._batches.get(principal, job_id)
        sent = row.client_request or {}
        return BatchCompletionsJob.model_validate(
            {
                "job_id": batch.id,
                "input_data_path": row.input_url,
                "output_data_path": row.output_url or "",
                "model_config": sent.get("model_config") or {},
                "priority": sent.get("priority"),
                "status": job_status(batch),
                "created_at": _iso(batch.created_at),
                "expires_at": _iso(batch.expires_at),
                "completed_at": _iso(batch.x_output_exported_at),
                "metadata": batch.metadata,
            }
        )


def _lines(content: list[dict[str, Any]], make: LineMaker) -> Iterator[bytes]:
    for number, item in enumerate(content, start=1):
        yield make(number, item)
