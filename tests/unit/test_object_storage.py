"""Object storage paths and bucket rules, llm-engine's v2 batch request (what its unchanged
client sends is accepted as nothing asked; hardware is refused by name), and the streaming
JSON array reader."""

from __future__ import annotations

import copy
import io
import json
from pathlib import Path
from typing import Any

import pytest

import app.services.json_items as json_items
from app.errors import Forbidden, InvalidRequest, PayloadTooLarge
from app.schemas.scale_batches import CreateBatchCompletionsV2Request
from app.services.json_items import array_items
from app.services.object_store import BucketAccess, ObjectPath, ObjectStore, parse_path
from app.services.scale_batches import LineMaker, asked_for, job_status

# The body `Completion.batch_create(use_v2=True, ...)` of scale-llm-engine 0.0.0b45 posts
# (its request model's `.dict()`: every field, ~40 of them null), captured from the client.
CLIENT_REQUEST = json.loads((Path(__file__).parent / "data" / "llmengine_v2_batch_request.json").read_text())


@pytest.mark.parametrize(
    "value",
    [
        "file:///etc/passwd",
        "http://169.254.169.254/latest",
        "https://bucket.example.com/k",
        "/tmp/x",
        "gs://bucket/key",
        "S3://bucket/key",
        "s3:/bucket/key",
    ],
)
def test_only_s3_paths_are_reachable(value: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse_path(value, param="output_data_path")
    assert caught.value.param == "output_data_path" and value in caught.value.message


@pytest.mark.parametrize(
    "value", ["s3://bucket", "s3://bucket/", "s3://Bad_Bucket/k", "s3://a/k", "s3://-bucket/k"]
)
def test_a_bucket_and_key_are_required(value: str) -> None:
    with pytest.raises(InvalidRequest):
        parse_path(value, param="input_data_path")


def test_a_path_splits_into_bucket_and_key() -> None:
    assert parse_path("s3://my-bucket/a/b c.json", param="p") == ObjectPath("my-bucket", "a/b c.json")


def test_buckets_per_tenant_and_for_everyone() -> None:
    access = BucketAccess.parse(" acme=acme-in,acme-out ; *=shared;beta=beta-data")
    assert access.allows("acme", "acme-out") and access.allows("acme", "shared")
    assert access.allows("beta", "beta-data") and access.allows("anyone", "shared")
    assert not access.allows("beta", "acme-in") and not access.allows("anyone", "acme-in")
    assert not BucketAccess.parse("").allows("acme", "shared")


@pytest.mark.parametrize("spec", ["acme", "acme=", "=bucket", "acme=Bad_Bucket"])
def test_a_malformed_bucket_list_is_refused(spec: str) -> None:
    with pytest.raises(ValueError, match="LLMQ_S3_BUCKETS"):
        BucketAccess.parse(spec)


def test_a_bucket_not_allowed_is_forbidden_naming_the_path() -> None:
    store = ObjectStore(BucketAccess.parse("acme=acme-in"), client_factory=lambda: pytest.fail("no call"))
    with pytest.raises(Forbidden) as caught:
        store.resolve("beta", "s3://acme-in/x.json", param="input_data_path")
    assert caught.value.status == 403 and "s3://acme-in/x.json" in caught.value.message
    assert caught.value.param == "input_data_path"
    assert store.resolve("acme", "s3://acme-in/x.json", param="p") == ObjectPath("acme-in", "x.json")


def test_the_unchanged_clients_request_asks_for_nothing() -> None:
    req = CreateBatchCompletionsV2Request.model_validate(CLIENT_REQUEST)
    assert asked_for(req) == []


@pytest.mark.parametrize(
    ("path", "value", "named"),
    [
        (("gpus",), 2, "gpus"),
        (("data_parallelism",), 4, "data_parallelism"),
        (("gpu_type",), "nvidia-ampere-a100", "gpu_type"),
        (("model_config", "checkpoint_path"), "s3://ckpt/m", "model_config.checkpoint_path"),
        (("model_config", "num_shards"), 4, "model_config.num_shards"),
        (("model_config", "trust_remote_code"), True, "model_config.trust_remote_code"),
        (("model_config", "quantization"), "awq", "model_config.quantization"),
        (("model_config", "max_context_length"), 4096, "model_config.max_context_length"),
    ],
)
def test_hardware_and_checkpoints_are_named(path: tuple[str, ...], value: Any, named: str) -> None:
    body = copy.deepcopy(CLIENT_REQUEST)
    target = body
    for part in path[:-1]:
        target = target[part]
    target[path[-1]] = value
    assert asked_for(CreateBatchCompletionsV2Request.model_validate(body)) == [named]


def test_items_become_batch_lines() -> None:
    make = LineMaker("tiny", priority=7)
    item = CLIENT_REQUEST["content"][0]
    line = json.loads(make(1, item))
    assert line["custom_id"] == "0" and line["url"] == "/v1/chat/completions" and line["method"] == "POST"
    body = line["body"]
    assert body["model"] == "tiny" and body["priority"] == 7 and "stream" not in body
    assert None not in body.values() and body["messages"][0]["content"] == "hi"
    with pytest.raises(InvalidRequest) as caught:
        make(2, {"model": None})
    assert caught.value.param == "content[1]"


def test_statuses_follow_the_batch_and_its_export() -> None:
    from app.schemas.batches import BatchObject, BatchProgress, RequestCounts

    def obj(status: str, queued: int = 0, exported: int | None = None, error: Any = None) -> BatchObject:
        return BatchObject(
            id="batch_x",
            endpoint="/v1/chat/completions",
            input_file_id="f",
            completion_window="60s",
            status=status,
            created_at=0,
            request_counts=RequestCounts(total=2, completed=0, failed=0),
            x_progress=BatchProgress(queued=queued),
            x_output_exported_at=exported,
            x_output_export_error=error,
        )

    assert job_status(obj("validating")) == "queued"
    assert job_status(obj("in_progress", queued=2)) == "queued"
    assert job_status(obj("in_progress", queued=1)) == "running"
    assert job_status(obj("completed")) == "running"  # ended, output not written yet
    assert job_status(obj("completed", exported=5)) == "completed"
    assert job_status(obj("expired", exported=5)) == "failed"
    assert job_status(obj("completed", error={"message": "x"})) == "failed"
    assert job_status(obj("cancelling")) == "cancelled"


def test_array_items_stream_across_chunk_boundaries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(json_items, "CHUNK_BYTES", 5)
    data = [{"a": 'x\\"y,]}', "b": [1, {"c": "]"}]}, "s", 3, [], {}, None, "é\\u00e9"]
    raw = json.dumps(data).encode()
    assert [json.loads(x) for x in array_items(io.BytesIO(raw), max_item_bytes=1000, param="p")] == data
    assert list(array_items(io.BytesIO(b" [ ] "), max_item_bytes=10, param="p")) == []


@pytest.mark.parametrize("raw", [b"{}", b"[1,]", b"[1", b"[1]x", b'["abc', b"[}]"])
def test_array_items_refuse_what_is_not_an_array(raw: bytes) -> None:
    with pytest.raises(InvalidRequest) as caught:
        list(array_items(io.BytesIO(raw), max_item_bytes=10, param="input_data_path"))
    assert caught.value.param == "input_data_path"


def test_an_item_over_the_limit_is_refused_without_reading_it_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(json_items, "CHUNK_BYTES", 64)
    reads: list[int] = []

    class Endless(io.RawIOBase):
        def readable(self) -> bool:
            return True

        def readinto(self, buffer: Any) -> int:
            reads.append(len(buffer))
            chunk = (b'["' if len(reads) == 1 else b"a") * len(buffer)
            buffer[: len(chunk)] = chunk
            return len(chunk)

    with pytest.raises(PayloadTooLarge):
        list(array_items(Endless(), max_item_bytes=1000, param="p"))  # type: ignore[arg-type]
    assert len(reads) < 40  # it stopped soon after the limit, not at the stream's end
