"""`GET /openapi.json`, generated from the same pydantic models the routes use."""

from __future__ import annotations

from functools import cache
from typing import Any

from flask import Blueprint, Response, jsonify
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from app.domain import metadata as metadata_rule
from app.domain.status import JobStatus
from app.domain.webhooks import DeliveryStatus
from app.schemas.batches import (
    BatchCreate,
    BatchInputLine,
    BatchList,
    BatchObject,
    BatchOutputLine,
    FileDeleted,
    FileList,
    FileObject,
    TextBatchInputLine,
)
from app.schemas.chat import ChatCompletionV2Request
from app.schemas.completion import (
    BenchChatCompletion,
    ChatCompletion,
    ChatCompletionChunk,
    RecordedStream,
    TextCompletion,
    TextCompletionChunk,
)
from app.schemas.jobs import ErrorResponse, JobList, JobObject, ModelList
from app.schemas.scale import (
    CompletionStreamV1Request,
    CompletionStreamV1Response,
    CompletionSyncV1Request,
    CompletionSyncV1Response,
)
from app.schemas.scale_batches import (
    BatchCompletionsJob,
    CancelBatchCompletionsV2Response,
    CreateBatchCompletionsV2Request,
    GetBatchCompletionV2Response,
)
from app.schemas.text_completion import CompletionRequest
from app.schemas.webhooks import (
    RotateSecret,
    WebhookDeliveryList,
    WebhookEndpointCreate,
    WebhookEndpointDeleted,
    WebhookEndpointList,
    WebhookEndpointObject,
    WebhookEndpointUpdate,
    WebhookEndpointWithSecret,
    WebhookEvent,
)
from app.services.jobs import MAX_PAGE
from app.services.webhooks import MAX_PAGE as WEBHOOK_PAGE

bp = Blueprint("openapi", __name__)

_REF = "#/components/schemas/{model}"

# (method, path, summary, request model, {status: response model}, path params, query params)
Query = tuple[str, dict[str, Any]]
Route = tuple[
    str, str, str, type[BaseModel] | None, dict[int, type[BaseModel] | None], list[str], list[Query]
]

# No U+0000: ids, cursors and filters are Postgres text (a NUL is a 400).
_TEXT: dict[str, Any] = {"type": "string", "pattern": "^[^\\u0000]*$"}
# A served model's name, as the query of Scale's routes carries it.
_MODEL_NAME: dict[str, Any] = {"type": "string", "minLength": 1, "maxLength": 256, "pattern": "^[^\\u0000]*$"}


# `metadata[KEY]=VALUE` filters, several AND-ed (app/domain/metadata.py).
_METADATA: Query = ("metadata", {"type": "object", **metadata_rule.JSON_SCHEMA})


def _limit(most: int) -> Query:
    return ("limit", {"type": "integer", "minimum": 1, "maximum": most})


ROUTES: list[Route] = [
    ("post", "/v2/jobs", "Queue one chat completion job", ChatCompletionV2Request, {202: JobObject}, [], []),
    (
        "get",
        "/v2/jobs",
        "List jobs, newest first",
        None,
        {200: JobList},
        [],
        [
            ("status", {"type": "string", "enum": [s.value for s in JobStatus]}),
            ("batch_id", _TEXT),
            _METADATA,
            ("after", _TEXT),
            _limit(MAX_PAGE),
        ],
    ),
    ("get", "/v2/jobs/{job_id}", "Read one job", None, {200: JobObject}, ["job_id"], []),
    ("post", "/v2/jobs/{job_id}/cancel", "Cancel a job", None, {200: JobObject}, ["job_id"], []),
    (
        "get",
        "/v2/jobs/{job_id}/stream",
        "Server-sent events of a job (Last-Event-ID resumes)",
        None,
        {200: None},
        ["job_id"],
        [("include_usage", {"type": "boolean"})],
    ),
    (
        "get",
        "/v2/jobs/{job_id}/events",
        "The recorded stream of a job",
        None,
        {200: RecordedStream},
        ["job_id"],
        [],
    ),
    (
        "post",
        "/v1/chat/completions",
        "Chat completion (waits; `stream: true` relays SSE)",
        ChatCompletionV2Request,
        {200: ChatCompletion, 202: JobObject},
        [],
        [],
    ),
    (
        "post",
        "/v2/chat/completions",
        "Chat completion (waits; `stream: true` relays SSE)",
        ChatCompletionV2Request,
        {200: ChatCompletion, 202: JobObject},
        [],
        [],
    ),
    (
        "post",
        "/bench/chat/completions",
        "Chat completion with bench settings and measured stats",
        ChatCompletionV2Request,
        {200: BenchChatCompletion, 202: JobObject},
        [],
        [],
    ),
    (
        "post",
        "/v1/completions",
        "Text completion, no chat template (waits; `stream: true` relays SSE of `text_completion` chunks)",
        CompletionRequest,
        {200: TextCompletion, 202: JobObject},
        [],
        [],
    ),
    (
        "post",
        "/v1/llm/completions-sync",
        "Scale LLM Engine v1 completion (waits; `request_id` is the job id)",
        CompletionSyncV1Request,
        {200: CompletionSyncV1Response, 202: JobObject},
        [],
        [("model_endpoint_name", _MODEL_NAME)],
    ),
    (
        "post",
        "/v1/llm/completions-stream",
        "Scale LLM Engine v1 completion as SSE of `CompletionStreamV1Response` (no [DONE] line)",
        CompletionStreamV1Request,
        {200: None},
        [],
        [("model_endpoint_name", _MODEL_NAME)],
    ),
    ("get", "/v1/models", "Served models", None, {200: ModelList}, [], []),
    (
        "post",
        "/v1/files",
        "Upload a JSONL batch input (multipart: file, purpose=batch)",
        None,
        {200: FileObject},
        [],
        [],
    ),
    (
        "get",
        "/v1/files",
        "List files, newest first",
        None,
        {200: FileList},
        [],
        [("purpose", _TEXT), ("after", _TEXT), _limit(10_000)],
    ),
    ("get", "/v1/files/{file_id}", "Read one file's metadata", None, {200: FileObject}, ["file_id"], []),
    ("get", "/v1/files/{file_id}/content", "A file's bytes", None, {200: None}, ["file_id"], []),
    ("delete", "/v1/files/{file_id}", "Delete a file", None, {200: FileDeleted}, ["file_id"], []),
    (
        "post",
        "/v1/batches",
        "Create a batch from an uploaded file or an s3:// JSONL object (`x_output_data_path`: "
        "also write the output there when it ends)",
        BatchCreate,
        {200: BatchObject},
        [],
        [],
    ),
    (
        "get",
        "/v1/batches",
        "List batches, newest first",
        None,
        {200: BatchList},
        [],
        [_METADATA, ("after", _TEXT), _limit(100)],
    ),
    ("get", "/v1/batches/{batch_id}", "Read one batch", None, {200: BatchObject}, ["batch_id"], []),
    ("post", "/v1/batches/{batch_id}/cancel", "Cancel a batch", None, {200: BatchObject}, ["batch_id"], []),
    (
        "get",
        "/v1/batches/{batch_id}/results",
        "Lines ended so far, in the order they ended (JSONL; `X-Llmq-Cursor` is the last "
        "line's cursor for `after`); with `follow=true` or `Accept: text/event-stream`, SSE "
        "until the batch ends (`Last-Event-ID` resumes)",
        None,
        {200: None},
        ["batch_id"],
        [
            ("after", {"type": "string", "pattern": "^[0-9]{1,18}\\.[0-9]{1,9}$"}),
            ("follow", {"type": "boolean"}),
        ],
    ),
    (
        "post",
        "/v2/batch-completions",
        "Scale LLM Engine v2 batch completions: `content` or an s3:// `input_data_path`, output "
        "written to the s3:// `output_data_path` (each item an llmq batch line; the job id is the batch's)",
        CreateBatchCompletionsV2Request,
        {200: BatchCompletionsJob},
        [],
        [],
    ),
    (
        "get",
        "/v2/batch-completions/{job_id}",
        "Read one v2 batch completions job",
        None,
        {200: GetBatchCompletionV2Response},
        ["job_id"],
        [],
    ),
    (
        "post",
        "/v2/batch-completions/{job_id}/actions/cancel",
        "Cancel a v2 batch completions job (`success: false` if it had already ended)",
        None,
        {200: CancelBatchCompletionsV2Response},
        ["job_id"],
        [],
    ),
    (
        "post",
        "/v1/batches/{batch_id}/retry",
        "A child batch of the failed and expired lines",
        None,
        {200: BatchObject},
        ["batch_id"],
        [],
    ),
    (
        "post",
        "/v1/webhook_endpoints",
        "Create a webhook endpoint (its signing secret is shown once)",
        WebhookEndpointCreate,
        {200: WebhookEndpointWithSecret},
        [],
        [],
    ),
    (
        "get",
        "/v1/webhook_endpoints",
        "List webhook endpoints, newest first",
        None,
        {200: WebhookEndpointList},
        [],
        [("after", _TEXT), _limit(WEBHOOK_PAGE)],
    ),
    (
        "get",
        "/v1/webhook_endpoints/{endpoint_id}",
        "Read one webhook endpoint",
        None,
        {200: WebhookEndpointObject},
        ["endpoint_id"],
        [],
    ),
    (
        "post",
        "/v1/webhook_endpoints/{endpoint_id}",
        "Change a webhook endpoint's url, event types or name",
        WebhookEndpointUpdate,
        {200: WebhookEndpointObject},
        ["endpoint_id"],
        [],
    ),
    (
        "delete",
        "/v1/webhook_endpoints/{endpoint_id}",
        "Delete a webhook endpoint and its deliveries",
        None,
        {200: WebhookEndpointDeleted},
        ["endpoint_id"],
        [],
    ),
    (
        "post",
        "/v1/webhook_endpoints/{endpoint_id}/rotate_secret",
        "A new signing secret, shown once",
        RotateSecret,
        {200: WebhookEndpointWithSecret},
        ["endpoint_id"],
        [],
    ),
    (
        "get",
        "/v1/webhook_endpoints/{endpoint_id}/deliveries",
        "An endpoint's events and their delivery, newest first",
        None,
        {200: WebhookDeliveryList},
        ["endpoint_id"],
        [
            ("status", {"type": "string", "enum": [d.value for d in DeliveryStatus]}),
            ("after", _TEXT),
            _limit(WEBHOOK_PAGE),
        ],
    ),
]

# Routes whose body is a multipart form, not JSON.
_MULTIPART = {
    ("post", "/v1/files"): {
        "type": "object",
        "required": ["file", "purpose"],
        "properties": {
            "file": {"type": "string", "format": "binary"},
            "purpose": {"type": "string", "enum": ["batch"]},
            "expires_after[anchor]": {"type": "string", "enum": ["created_at"]},
            "expires_after[seconds]": {"type": "integer", "minimum": 3600, "maximum": 2592000},
        },
    }
}

_ERRORS = {
    400: "Invalid request",
    401: "Missing or invalid key",
    403: "A bucket this tenant may not use, or one the object store refuses",
    404: "Not found",
    409: "Conflict",
    413: "Too large",
    422: "Idempotency key reused with another body",
    429: "Rate limited",
}
# Bodies that are not one JSON document: each SSE `data:` line of a stream is a chunk (or
# an `ErrorResponse`); each line of a file is a `BatchInputLine` (an uploaded file) or a
# `BatchOutputLine` (a batch's output or error file); a batch's results are output lines,
# and followed, end with its `batch` event.
_STREAMED: dict[tuple[str, str], list[tuple[str, list[type[BaseModel]]]]] = {
    ("get", "/v2/jobs/{job_id}/stream"): [
        ("text/event-stream", [ChatCompletionChunk, TextCompletionChunk, ErrorResponse])
    ],
    ("post", "/v1/llm/completions-stream"): [("text/event-stream", [CompletionStreamV1Response])],
    ("get", "/v1/files/{file_id}/content"): [
        ("application/jsonl", [BatchInputLine, TextBatchInputLine, BatchOutputLine])
    ],
    ("get", "/v1/batches/{batch_id}/results"): [
        ("application/jsonl", [BatchOutputLine]),
        ("text/event-stream", [BatchOutputLine, BatchObject, ErrorResponse]),
    ],
}

_EXTRA_MODELS: list[type[BaseModel]] = [
    WebhookEvent,
    ChatCompletion,
    BenchChatCompletion,
    ChatCompletionChunk,
    BatchOutputLine,
    BatchInputLine,
    TextBatchInputLine,
    TextCompletionChunk,
]


def _schemas() -> dict[str, Any]:
    models: set[type[BaseModel]] = {ErrorResponse, *_EXTRA_MODELS}
    for _, _, _, req, responses, _, _ in ROUTES:
        if req is not None:
            models.add(req)
        models.update(m for m in responses.values() if m is not None)
    requests = (
        ChatCompletionV2Request,
        CompletionRequest,
        CompletionSyncV1Request,
        CompletionStreamV1Request,
    )
    keyed = [(m, "validation" if m in requests else "serialization") for m in models]
    _, top = models_json_schema(keyed, ref_template=_REF)  # type: ignore[arg-type]
    return dict(top.get("$defs", {}))


# Query parameters a route cannot do without (Scale's routes name the model in the query).
_REQUIRED_QUERY = {"model_endpoint_name"}


def _query(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    param = {"name": name, "in": "query", "required": name in _REQUIRED_QUERY, "schema": schema}
    if schema.get("type") == "object":  # sent as name[key]=value
        param.update(style="deepObject", explode=True)
    return param


def _operation(route: Route) -> dict[str, Any]:
    method, _, summary, req, responses, path_params, query_params = route
    op: dict[str, Any] = {
        "summary": summary,
        "operationId": f"{method}_{route[1].strip('/').replace('/', '_').replace('{', '').replace('}', '')}",
        # The key as a bearer token, or as the user name of HTTP Basic (Scale's client).
        "security": [{"bearer": []}, {"basic": []}],
        "parameters": [{"name": p, "in": "path", "required": True, "schema": _TEXT} for p in path_params]
        + [_query(q, schema) for q, schema in query_params],
        "responses": {},
    }
    form = _MULTIPART.get((method, route[1]))
    if form is not None:
        op["requestBody"] = {"required": True, "content": {"multipart/form-data": {"schema": form}}}
    if req is not None:
        op["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": _REF.format(model=req.__name__)}}},
        }
    streamed = _STREAMED.get((method, route[1]))
    for status, model in responses.items():
        content: dict[str, Any] = (
            {"application/json": {"schema": {"$ref": _REF.format(model=model.__name__)}}} if model else {}
        )
        if model is None and streamed is not None:
            content = {
                mime: {"schema": {"anyOf": [{"$ref": _REF.format(model=m.__name__)} for m in models]}}
                for mime, models in streamed
            }
        op["responses"][str(status)] = {"description": "OK", "content": content}
    for status, text in _ERRORS.items():
        op["responses"][str(status)] = {
            "description": text,
            "content": {"application/json": {"schema": {"$ref": _REF.format(model="ErrorResponse")}}},
        }
    return op


@cache
def spec() -> dict[str, Any]:
    paths: dict[str, dict[str, Any]] = {}
    for route in ROUTES:
        paths.setdefault(route[1], {})[route[0]] = _operation(route)
    return {
        "openapi": "3.1.0",
        "info": {"title": "llmq", "version": "0.1.0", "description": "Queue-based batch inference"},
        "paths": paths,
        "components": {
            "schemas": _schemas(),
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"},
                "basic": {"type": "http", "scheme": "basic"},
            },
        },
    }


@bp.get("/openapi.json")
def openapi_json() -> Response:
    return jsonify(spec())
