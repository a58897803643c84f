"""llm-engine's v2 batch completions and batch input/output in object storage, through the
Flask app, against real Postgres and Redis and a real S3 API server (moto's server mode):
what the unchanged client sends is accepted, hardware is refused by name, each tenant
reaches only its buckets and nothing but s3:// paths, inputs are read into batches and
outputs written (by the workers' exporter, driven here) in input order."""

from __future__ import annotations

import copy
import json
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from flask import Flask
from flask.testing import FlaskClient
from sqlalchemy import text

from app.api import create_app
from app.container import Services, build_services
from app.services.batch_export import BatchExports
from tests.helpers import Stores, auth, jsonl, line, make_settings
from tests.s3 import MotoServer

CLIENT_REQUEST = json.loads(
    (Path(__file__).parents[1] / "unit" / "data" / "llmengine_v2_batch_request.json").read_text()
)
# A completion item as the same client sends it (FilteredCompletionV2Request's `.dict()`).
COMPLETION_ITEM = json.loads(
    (Path(__file__).parents[1] / "unit" / "data" / "llmengine_v2_completion_item.json").read_text()
)
SUFFIX = secrets.token_hex(3)
TENANT_A = f"s3-a-{SUFFIX}"
TENANT_B = f"s3-b-{SUFFIX}"
BUCKET_A = f"llmq-a-{SUFFIX}"
BUCKET_B = f"llmq-b-{SUFFIX}"
SHARED = f"llmq-shared-{SUFFIX}"
GONE = f"llmq-gone-{SUFFIX}"  # allowed, but deleted before a batch's export


@pytest.fixture(scope="module")
def s3_services(stores: Stores, moto_server: MotoServer) -> Iterator[Services]:
    for bucket in (BUCKET_A, BUCKET_B, SHARED, GONE):
        moto_server.make_bucket(bucket)
    settings = make_settings(
        stores,
        s3_buckets=f"{TENANT_A}={BUCKET_A},{GONE};{TENANT_B}={BUCKET_B};*={SHARED}",
        s3_part_bytes=5 * 1024 * 1024,
    )
    svc = build_services(settings, s3_client=moto_server.client)
    yield svc
    svc.close()


@pytest.fixture(scope="module")
def s3_app(s3_services: Services) -> Flask:
    return create_app(services=s3_services)


@pytest.fixture
def c(s3_app: Flask) -> FlaskClient:
    return s3_app.test_client()


@pytest.fixture(scope="module")
def keys(s3_services: Services) -> dict[str, str]:
    return {"a": s3_services.keys.create_key(TENANT_A), "b": s3_services.keys.create_key(TENANT_B)}


def request_body(n: int = 3, **changes: Any) -> dict[str, Any]:
    """The unchanged client's body (every default and null it sends), with `n` items."""
    body = copy.deepcopy(CLIENT_REQUEST)
    item = body["content"][0]
    body["content"] = [
        {**copy.deepcopy(item), "messages": [{"role": "user", "content": f"item {i}", "name": None}]}
        for i in range(n)
    ]
    body["output_data_path"] = f"s3://{BUCKET_A}/out/{secrets.token_hex(4)}.json"
    body.update(changes)
    return body


def put(moto: MotoServer, bucket: str, key: str, data: bytes) -> str:
    moto.client().put_object(Bucket=bucket, Key=key, Body=data)
    return f"s3://{bucket}/{key}"


def get(moto: MotoServer, url: str) -> bytes:
    bucket, _, key = url.removeprefix("s3://").partition("/")
    return bytes(moto.client().get_object(Bucket=bucket, Key=key)["Body"].read())


def finish_lines(services: Services, batch_id: str, failed: set[int] = frozenset()) -> None:  # type: ignore[assignment]
    """Stand in for the worker: every line succeeds with a completion naming its line number,
    except `failed`, then the lifecycle finalizes the batch as it would."""
    from app.services.batch_lifecycle import BatchLifecycle

    with services.db.session() as s:
        s.execute(
            text(
                """
                UPDATE jobs SET status = CASE WHEN line_no = ANY(:failed) THEN 'failed' ELSE 'succeeded' END,
                  response = CASE WHEN line_no = ANY(:failed) THEN NULL ELSE json_build_object(
                    'id', 'chatcmpl-' || line_no, 'object', 'chat.completion', 'line', line_no) END,
                  error = CASE WHEN line_no = ANY(:failed) THEN json_build_object('error', json_build_object(
                    'message', 'boom', 'type', 'api_error', 'param', NULL, 'code', NULL)) END,
                  succeeded_at = CASE WHEN line_no = ANY(:failed) THEN NULL ELSE now() END,
                  failed_at = CASE WHEN line_no = ANY(:failed) THEN now() END
                WHERE batch_id = :b
                """
            ),
            {"b": batch_id, "failed": sorted(failed)},
        )
    BatchLifecycle(services.db, services.queue, services.events, chunk=10, window=10).finalize_done()


# --- the v2 request ----------------------------------------------------------------------


def test_the_unchanged_clients_body_creates_a_queued_job(c: FlaskClient, keys, s3_services) -> None:
    body = request_body(3, priority="5", max_runtime_sec=7200)
    r = c.post("/v2/batch-completions", json=body, headers=auth(keys["a"]))
    assert r.status_code == 200, r.get_json()
    job = r.get_json()
    assert job["status"] == "queued" and job["job_id"].startswith("batch_")
    assert job["output_data_path"] == body["output_data_path"] and job["input_data_path"] is None
    assert job["model_config"] == body["model_config"] and job["priority"] == "5"
    assert job["metadata"] == {"team": "x"} and job["completed_at"] is None
    got = c.get(f"/v2/batch-completions/{job['job_id']}", headers=auth(keys["a"]))
    assert got.status_code == 200 and got.get_json()["job"] == job
    # Each item is a line of an llmq batch, at the batch's priority, due in max_runtime_sec.
    batch = c.get(f"/v1/batches/{job['job_id']}", headers=auth(keys["a"])).get_json()
    assert batch["request_counts"]["total"] == 3 and batch["metadata"] == {"team": "x"}
    assert batch["expires_at"] - batch["created_at"] == 7200
    with s3_services.db.session() as s:
        rows = s.execute(
            text("SELECT line_no, priority, model, custom_id FROM jobs WHERE batch_id = :b ORDER BY line_no"),
            {"b": job["job_id"]},
        ).all()
    assert [tuple(r) for r in rows] == [(i + 1, 5, "api-only", str(i)) for i in range(3)]
    # Another tenant sees no such job.
    assert c.get(f"/v2/batch-completions/{job['job_id']}", headers=auth(keys["b"])).status_code == 404


def test_completion_items_become_text_completion_lines(c: FlaskClient, keys, s3_services) -> None:
    items = [{**COMPLETION_ITEM, "prompt": f"Once upon a time {i}"} for i in range(3)]
    r = c.post("/v2/batch-completions", json=request_body(content=items), headers=auth(keys["a"]))
    assert r.status_code == 200, r.get_json()
    batch = c.get(f"/v1/batches/{r.get_json()['job_id']}", headers=auth(keys["a"])).get_json()
    assert batch["endpoint"] == "/v1/completions" and batch["request_counts"]["total"] == 3
    with s3_services.db.session() as s:
        kinds = s.execute(
            text("SELECT DISTINCT kind FROM jobs WHERE batch_id = :b"), {"b": batch["id"]}
        ).all()
    assert [k[0] for k in kinds] == ["completion"]


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"gpus": 1}, "gpus"),
        ({"data_parallelism": 2}, "data_parallelism"),
        (
            {"model_config": {**CLIENT_REQUEST["model_config"], "checkpoint_path": "s3://x/ckpt"}},
            "model_config.checkpoint_path",
        ),
        ({"model_config": {**CLIENT_REQUEST["model_config"], "num_shards": 8}}, "model_config.num_shards"),
        (
            {"model_config": {**CLIENT_REQUEST["model_config"], "tensor_parallel_size": 2}},
            "model_config.tensor_parallel_size",
        ),
    ],
)
def test_hardware_and_checkpoints_are_refused_by_name(c: FlaskClient, keys, change, named) -> None:
    r = c.post("/v2/batch-completions", json=request_body(1, **change), headers=auth(keys["a"]))
    assert r.status_code == 400
    error = r.get_json()["error"]
    assert error["param"] == named and named in error["message"] and error["code"] == "unsupported_parameter"


def test_bad_requests_name_their_field(c: FlaskClient, keys) -> None:
    cases = [
        (
            request_body(1, model_config={**CLIENT_REQUEST["model_config"], "model": "nope"}),
            404,
            "model_config.model",
        ),
        (request_body(1, content=None), 400, "content"),
        (request_body(1, input_data_path=f"s3://{BUCKET_A}/in.json"), 400, "content"),
        (request_body(1, priority="high"), 400, "priority"),
        (request_body(1, labels={"k" * 100: "v"}), 400, "labels"),
        (request_body(1, content=[{"max_tokens": 3}]), 400, "content[0]"),
        (request_body(1, content=[*request_body(1)["content"], COMPLETION_ITEM]), 400, "content[1]"),
    ]
    for body, status, param in cases:
        r = c.post("/v2/batch-completions", json=body, headers=auth(keys["a"]))
        assert r.status_code == status and r.get_json()["error"]["param"].startswith(param), r.get_json()


@pytest.mark.parametrize(
    "path",
    [
        "file:///etc/passwd",
        "http://127.0.0.1:9/x.json",
        "https://s3.amazonaws.com/b/k",
        "/tmp/out.json",
        "gs://b/k",
    ],
)
@pytest.mark.parametrize("field", ["output_data_path", "input_data_path"])
def test_nothing_but_s3_is_reachable(c: FlaskClient, keys, path: str, field: str) -> None:
    changes: dict[str, Any] = {field: path}
    if field == "input_data_path":
        changes["content"] = None
    r = c.post("/v2/batch-completions", json=request_body(1, **changes), headers=auth(keys["a"]))
    assert r.status_code == 400
    error = r.get_json()["error"]
    assert error["param"] == field and path in error["message"] and error["code"] == "unsupported_path"


def test_a_tenant_reaches_only_its_buckets(c: FlaskClient, keys, moto_server) -> None:
    theirs = put(moto_server, BUCKET_B, "in.json", json.dumps(CLIENT_REQUEST["content"]).encode())
    for changes, field in (
        ({"output_data_path": f"s3://{BUCKET_B}/out.json"}, "output_data_path"),
        ({"input_data_path": theirs, "content": None}, "input_data_path"),
        ({"output_data_path": "s3://not-configured-anywhere/out.json"}, "output_data_path"),
    ):
        r = c.post("/v2/batch-completions", json=request_body(1, **changes), headers=auth(keys["a"]))
        assert r.status_code == 403, r.get_json()
        error = r.get_json()["error"]
        assert error["param"] == field and error["code"] == "bucket_not_allowed"
        assert changes[field] in error["message"]
    # The shared bucket is every tenant's.
    shared = request_body(1, output_data_path=f"s3://{SHARED}/b.json")
    assert c.post("/v2/batch-completions", json=shared, headers=auth(keys["b"])).status_code == 200


def test_a_missing_input_object_is_named(c: FlaskClient, keys) -> None:
    path = f"s3://{BUCKET_A}/no-such-object.json"
    r = c.post(
        "/v2/batch-completions",
        json=request_body(1, input_data_path=path, content=None),
        headers=auth(keys["a"]),
    )
    assert r.status_code == 400
    assert r.get_json()["error"]["code"] == "object_not_found" and path in r.get_json()["error"]["message"]


# --- inputs and outputs ------------------------------------------------------------------


def test_an_s3_input_and_output_in_input_order(c: FlaskClient, keys, moto_server, s3_services) -> None:
    items = request_body(5)["content"]
    source = put(moto_server, BUCKET_A, "in/items.json", json.dumps(items, indent=2).encode())
    body = request_body(1, input_data_path=source, content=None)
    r = c.post("/v2/batch-completions", json=body, headers=auth(keys["a"]))
    assert r.status_code == 200, r.get_json()
    job = r.get_json()
    assert job["input_data_path"] == source and job["status"] == "queued"
    finish_lines(s3_services, job["job_id"], failed={3})
    assert (
        c.get(f"/v2/batch-completions/{job['job_id']}", headers=auth(keys["a"])).get_json()["job"]["status"]
        == "running"
    )  # ended, not yet written
    assert BatchExports(s3_services.db, s3_services.batches.objects()).export_due() >= 1
    done = c.get(f"/v2/batch-completions/{job['job_id']}", headers=auth(keys["a"])).get_json()["job"]
    assert done["status"] == "completed" and done["completed_at"]
    output = json.loads(get(moto_server, body["output_data_path"]))
    assert len(output) == 5
    assert [x.get("line") for x in output] == [1, 2, None, 4, 5]  # input order
    assert output[2] == {"message": "boom", "type": "api_error", "param": None, "code": None}


def test_a_bad_item_in_an_s3_input_is_named(c: FlaskClient, keys, moto_server) -> None:
    items = request_body(3)["content"]
    items[1]["temperature"] = "hot"
    source = put(moto_server, BUCKET_A, "in/bad.json", json.dumps(items).encode())
    r = c.post(
        "/v2/batch-completions",
        json=request_body(1, input_data_path=source, content=None),
        headers=auth(keys["a"]),
    )
    assert r.status_code == 400
    assert "line 2" in r.get_json()["error"]["message"] and r.get_json()["errors"]["data"][0]["line"] == 2
    not_array = put(moto_server, BUCKET_A, "in/object.json", b'{"messages": []}')
    r = c.post(
        "/v2/batch-completions",
        json=request_body(1, input_data_path=not_array, content=None),
        headers=auth(keys["a"]),
    )
    assert r.status_code == 400 and r.get_json()["error"]["param"] == "input_data_path"


def test_cancel(c: FlaskClient, keys, s3_services, moto_server) -> None:
    job = c.post("/v2/batch-completions", json=request_body(4), headers=auth(keys["a"])).get_json()
    r = c.post(f"/v2/batch-completions/{job['job_id']}/actions/cancel", json={}, headers=auth(keys["a"]))
    assert r.status_code == 200 and r.get_json() == {"success": True}
    got = c.get(f"/v2/batch-completions/{job['job_id']}", headers=auth(keys["a"])).get_json()["job"]
    assert got["status"] == "cancelled"
    from app.services.batch_lifecycle import BatchLifecycle

    BatchLifecycle(s3_services.db, s3_services.queue, s3_services.events, chunk=10, window=10).finalize_done()
    BatchExports(s3_services.db, s3_services.batches.objects()).export_due()
    output = json.loads(get(moto_server, job["output_data_path"]))
    assert [x["code"] for x in output] == ["batch_cancelled"] * 4
    # An ended job is not cancelled again; another tenant's is not found.
    other = c.post("/v2/batch-completions", json=request_body(1), headers=auth(keys["a"])).get_json()
    finish_lines(s3_services, other["job_id"])
    r = c.post(f"/v2/batch-completions/{other['job_id']}/actions/cancel", json={}, headers=auth(keys["a"]))
    assert r.get_json() == {"success": False}
    r = c.post(f"/v2/batch-completions/{other['job_id']}/actions/cancel", json={}, headers=auth(keys["b"]))
    assert r.status_code == 404


def test_openai_batches_read_and_write_s3(c: FlaskClient, keys, moto_server, s3_services) -> None:
    source = put(moto_server, BUCKET_A, "openai/in.jsonl", jsonl([line(i) for i in range(4)]))
    target = f"s3://{BUCKET_A}/openai/out-{secrets.token_hex(3)}.jsonl"
    r = c.post(
        "/v1/batches",
        json={
            "input_file_id": source,
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
            "x_output_data_path": target,
        },
        headers=auth(keys["a"]),
    )
    assert r.status_code == 200, r.get_json()
    batch = r.get_json()
    assert batch["x_input_data_path"] == source and batch["x_output_data_path"] == target
    assert batch["request_counts"]["total"] == 4 and batch["input_file_id"].startswith("file_")
    # The input file is an llmq file now, the object's bytes as they were.
    content = c.get(f"/v1/files/{batch['input_file_id']}/content", headers=auth(keys["a"]))
    assert content.data == get(moto_server, source)
    finish_lines(s3_services, batch["id"], failed={2})
    BatchExports(s3_services.db, s3_services.batches.objects()).export_due()
    done = c.get(f"/v1/batches/{batch['id']}", headers=auth(keys["a"])).get_json()
    assert done["x_output_exported_at"] and done["x_output_export_error"] is None
    out = [json.loads(x) for x in get(moto_server, target).splitlines()]
    assert [x["custom_id"] for x in out] == [f"req-{i}" for i in range(4)]
    assert out[1]["response"]["status_code"] == 500 and out[0]["response"]["status_code"] == 200
    # The same rules as v2: another tenant's bucket, another scheme.
    for field, value, status in (
        ("x_output_data_path", f"s3://{BUCKET_B}/x.jsonl", 403),
        ("input_file_id", f"s3://{BUCKET_B}/x.jsonl", 403),
        ("input_file_id", "file:///etc/passwd", 400),
        ("x_output_data_path", "https://example.com/x", 400),
    ):
        body = {
            "input_file_id": source,
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
            field: value,
        }
        r = c.post("/v1/batches", json=body, headers=auth(keys["a"]))
        assert (r.status_code, r.get_json()["error"]["param"]) == (status, field), r.get_json()


def test_an_output_the_store_refuses_fails_the_job(c: FlaskClient, keys, moto_server, s3_services) -> None:
    """The bucket was allowed at creation but is gone by the export: the job fails with the
    store's error, it is not retried for ever."""
    job = c.post(
        "/v2/batch-completions",
        json=request_body(1, output_data_path=f"s3://{GONE}/o.json"),
        headers=auth(keys["a"]),
    ).get_json()
    moto_server.client().delete_bucket(Bucket=GONE)
    finish_lines(s3_services, job["job_id"])
    BatchExports(s3_services.db, s3_services.batches.objects()).export_due()
    got = c.get(f"/v2/batch-completions/{job['job_id']}", headers=auth(keys["a"])).get_json()["job"]
    assert got["status"] == "failed"
    batch = c.get(f"/v1/batches/{job['job_id']}", headers=auth(keys["a"])).get_json()
    assert (
        batch["x_output_export_error"]["code"] == "object_not_found"
        and GONE in batch["x_output_export_error"]["message"]
    )


def test_a_store_that_cannot_be_reached_is_tried_again(
    c: FlaskClient, keys, moto_server, s3_services
) -> None:
    """Unreachable is not final: the export waits (the job stays `running`, no error) and
    succeeds once the store answers."""
    import boto3
    from botocore.config import Config

    from app.services.object_store import BucketAccess, ObjectStore

    job = c.post("/v2/batch-completions", json=request_body(2), headers=auth(keys["a"])).get_json()
    finish_lines(s3_services, job["job_id"])
    dead = ObjectStore(
        BucketAccess.parse(f"*={BUCKET_A}"),
        lambda: boto3.session.Session().client(
            "s3",
            endpoint_url="http://127.0.0.1:9",
            aws_access_key_id="x",
            aws_secret_access_key="y",
            region_name="us-east-1",
            config=Config(retries={"max_attempts": 1}, connect_timeout=1),
        ),
    )
    assert BatchExports(s3_services.db, dead).export_due() == 0
    got = c.get(f"/v2/batch-completions/{job['job_id']}", headers=auth(keys["a"])).get_json()["job"]
    assert got["status"] == "running"
    batch = c.get(f"/v1/batches/{job['job_id']}", headers=auth(keys["a"])).get_json()
    assert batch["x_output_export_error"] is None and batch["x_output_exported_at"] is None
    # Its retry is RETRY_SECONDS away; time passes.
    with s3_services.db.session() as s:
        s.execute(text("UPDATE batches SET export_lease_until = now() WHERE id = :b"), {"b": job["job_id"]})
    assert BatchExports(s3_services.db, s3_services.batches.objects()).export_due() >= 1
    got = c.get(f"/v2/batch-completions/{job['job_id']}", headers=auth(keys["a"])).get_json()["job"]
    assert got["status"] == "completed" and len(json.loads(get(moto_server, job["output_data_path"]))) == 2
