"""What goes on the wire is what the OpenAPI document describes: the shapes the worker and
the API build validate against the pydantic models, and no error body is built outside
`app/errors.py`."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from app.completions import (
    ChunkChoiceDict,
    ChunkDict,
    CompletionChoiceDict,
    CompletionDict,
    UsageChunkDict,
    UsageDict,
    chunk_header,
    completion,
    usage,
    usage_chunk,
)
from app.errors import InvalidRequest, error_body, line_error
from app.schemas.batches import BatchLineError, BatchOutputLine
from app.schemas.completion import ChatCompletion, ChatCompletionChunk, Choice, StreamingChoice, Usage
from app.schemas.jobs import ErrorResponse
from app.services.batch_output import output_line
from tests.unit.fakes import FakeStreams
from worker.deltas import StreamShape
from worker.engine import ChoiceDelta, EngineUpdate, TokenLogprob
from worker.response import FinalChoice

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("typed", "model"),
    [
        (UsageDict, Usage),
        (ChunkChoiceDict, StreamingChoice),
        (ChunkDict, ChatCompletionChunk),
        (UsageChunkDict, ChatCompletionChunk),
        (CompletionChoiceDict, Choice),
        (CompletionDict, ChatCompletion),
    ],
)
def test_each_typed_dict_only_has_fields_its_model_documents(typed: Any, model: type[BaseModel]) -> None:
    assert set(typed.__annotations__) <= set(model.model_fields)


def _chunks(shape: StreamShape, finals: list[FinalChoice] | None = None) -> list[dict[str, Any]]:
    streams = FakeStreams()
    stream = streams.open("job_1", 1, chunk_header("job_1", 1700000000, "tiny", "fp_1"), n=1)
    stream.reshape(shape, 1)
    lp = TokenLogprob("a", -0.5, [97], [("a", -0.5, [97])])
    stream.add(EngineUpdate([ChoiceDelta(0, "a", [1], [lp])], 3, 0, False))
    stream.add(EngineUpdate([ChoiceDelta(0, "b", [2], None, "stop")], 3, 0, True))
    if finals is not None:
        stream.complete(finals)
    stream.end_event("succeeded", usage=dict(usage(3, 2, 0)), error=None)
    return [e["data"] for e in streams.shipped["job_1"] if e["type"] == "chunk"]


@pytest.mark.parametrize(
    "shape",
    [
        StreamShape(echo="Q: ", logprobs=True),
        StreamShape(mode="arguments", tool_name="f", tool_call_id="call_1"),
        StreamShape(mode="arguments", tool_name="f", legacy=True),
    ],
)
def test_every_streamed_chunk_is_a_documented_chunk(shape: StreamShape) -> None:
    chunks = _chunks(shape)
    assert chunks
    for chunk in chunks:
        assert ChatCompletionChunk.model_validate(chunk).id == "chatcmpl-1"


def test_buffered_tool_calls_stream_as_documented_chunks() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    tools = FinalChoice(0, {"role": "assistant", "content": None, "tool_calls": [call]}, "tool_calls", None)
    legacy = FinalChoice(
        0, {"role": "assistant", "content": None, "function_call": call["function"]}, "stop", None
    )
    for final in (tools, legacy):
        (chunk,) = _chunks(StreamShape(mode="buffered"), [final])
        ChatCompletionChunk.model_validate(chunk)


def test_the_completion_and_its_usage_chunk_are_documented() -> None:
    choice: CompletionChoiceDict = {
        "index": 0,
        "message": {"role": "assistant", "content": "hi", "tool_calls": None},
        "logprobs": None,
        "finish_reason": "stop",
    }
    body = completion(
        "job_7", 1, "tiny", [choice], usage(3, 2, 1), system_fingerprint="fp", service_tier=None
    )
    assert ChatCompletion.model_validate(body).id == "chatcmpl-7"
    final = usage_chunk("job_7", 1, "tiny", dict(usage(3, 2, 1)))
    parsed = ChatCompletionChunk.model_validate(final)
    assert parsed.id == body["id"] and parsed.choices == [] and parsed.usage is not None


def test_error_bodies_and_batch_lines_are_documented() -> None:
    assert ErrorResponse.model_validate(InvalidRequest("no", param="x").body()).error.param == "x"
    assert ErrorResponse.model_validate(error_body("boom", "engine_error")).error.type == "engine_error"
    BatchLineError.model_validate(line_error("batch_expired", "too late"))
    for status, response, error in [
        ("succeeded", {"id": "chatcmpl-1"}, None),
        ("failed", None, error_body("bad", "invalid_request_error")),
        ("failed", None, None),
        ("expired", None, None),
        ("cancelled", None, None),
    ]:
        line = output_line("job_1", "c1", status, response, error)
        # Built without the model, it is what the model dumps, byte for byte once encoded.
        dumped = BatchOutputLine.model_validate(line).model_dump()
        assert json.dumps(line) == json.dumps(dumped) and dumped["custom_id"] == "c1"


def _dicts_with(tree: ast.AST, keys: set[str]) -> list[int]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            named = {k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
            if keys <= named:
                found.append(node.lineno)
    return found


def test_no_error_body_is_built_outside_the_one_helper() -> None:
    built = []
    for path in [*ROOT.joinpath("app").rglob("*.py"), *ROOT.joinpath("worker").rglob("*.py")]:
        if path == ROOT / "app" / "errors.py":
            continue
        tree = ast.parse(path.read_text())
        for keys in ({"message", "type"}, {"message", "code"}, {"param", "code"}):
            built += [f"{path.relative_to(ROOT)}:{line}" for line in _dicts_with(tree, keys)]
    assert built == []


def test_the_openapi_document_names_the_streamed_shapes() -> None:
    from app.api.openapi import spec

    doc = spec()
    stream = doc["paths"]["/v2/jobs/{job_id}/stream"]["get"]["responses"]["200"]["content"]
    lines = doc["paths"]["/v1/files/{file_id}/content"]["get"]["responses"]["200"]["content"]
    assert "ChatCompletionChunk" in str(stream["text/event-stream"])
    assert "BatchOutputLine" in str(lines["application/jsonl"])
    assert "function_call" in doc["components"]["schemas"]["DeltaMessage"]["properties"]
