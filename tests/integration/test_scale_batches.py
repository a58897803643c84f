"""llm-engine's v2 batch completions end to end: the API under gunicorn and a vLLM worker on
the tiny model, both pointed at a real S3 API server (moto's server mode) the way boto3 is
configured (AWS_* variables, AWS_ENDPOINT_URL_S3), with their own database and Redis.
Inline content and an s3:// input run to an output object with one entry per input, in
order; a running job is cancelled. The same again through Scale's unchanged client."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.cli.embedded import free_port, redis_start
from app.connections import ADMIN_POOL
from app.db import Database
from app.services.keys import KeyService
from tests.helpers import E2E_MODEL, ROOT, ApiProcess, Stores, WorkerProcess, fresh_database, stack_env
from tests.s3 import MotoServer

pytestmark = pytest.mark.integration

TENANT = "tenant-scale-e2e"
BUCKET = f"llmq-e2e-{secrets.token_hex(3)}"


@dataclass
class S3Stack:
    url: str
    key: str
    moto: MotoServer
    http: httpx.Client

    def read(self, url: str) -> Any:
        bucket, _, key = url.removeprefix("s3://").partition("/")
        return json.loads(self.moto.client().get_object(Bucket=bucket, Key=key)["Body"].read())


@pytest.fixture(scope="module")
def s3_stack(stores: Stores, tiny_model: Path, logs_dir: Path, moto_server: MotoServer) -> Iterator[S3Stack]:
    moto_server.make_bucket(BUCKET)
    port = free_port(56800)
    redis_server = redis_start(Path(tempfile.mkdtemp(prefix="llmq-s3-redis-")), port, persistent=False)
    # Its own database and Redis: the session's workers would count this one as gone.
    own = Stores(fresh_database(stores), f"redis://127.0.0.1:{port}/0")
    env = stack_env(
        own,
        tiny_model,
        E2E_MODEL,
        LLMQ_S3_BUCKETS=f"{TENANT}={BUCKET}",
        LLMQ_S3_EXPORT_POLL_SECONDS="0.5",
        **moto_server.env(),
    )
    worker = WorkerProcess(env, logs_dir / "s3-worker.log").start()
    api = ApiProcess(env, logs_dir / "s3-api.log")
    own_db = Database.from_url(own.database_url, ADMIN_POOL)
    key = KeyService(own_db).create_key(TENANT)
    own_db.dispose()
    http = httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {key}"}, timeout=60)
    try:
        yield S3Stack(api.url, key, moto_server, http)
    finally:
        http.close()
        api.stop()
        worker.stop()
        redis_server.stop()


def chat_items(n: int) -> list[dict[str, Any]]:
    return [
        {"messages": [{"role": "user", "content": f"Item {i}: say something."}], "max_tokens": 3 + i % 3}
        for i in range(n)
    ]


def request(stack: S3Stack, **fields: Any) -> dict[str, Any]:
    return {
        "output_data_path": f"s3://{BUCKET}/out/{secrets.token_hex(4)}.json",
        "model_config": {
            "model": E2E_MODEL,
            "num_shards": 1,
            "trust_remote_code": False,
            "checkpoint_path": None,
        },
        "data_parallelism": 1,
        "labels": {"team": "e2e"},
        **fields,
    }


def wait_job(stack: S3Stack, job_id: str, until: set[str], timeout: float = 240) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        job = stack.http.get(f"/v2/batch-completions/{job_id}").json()["job"]
        if job["status"] in until:
            return dict(job)
        assert time.monotonic() < deadline, job
        time.sleep(0.5)


def check_output(stack: S3Stack, job: dict[str, Any], n: int) -> None:
    """One entry per input, in input order: each a chat completion from the tiny model."""
    output = stack.read(job["output_data_path"])
    assert isinstance(output, list) and len(output) == n
    for i, entry in enumerate(output):
        assert entry["object"] == "chat.completion" and entry["model"] == E2E_MODEL, entry
        assert entry["usage"]["completion_tokens"] <= 3 + i % 3  # each item's own max_tokens


def test_inline_content_runs_to_an_output_object_in_order(s3_stack: S3Stack) -> None:
    r = s3_stack.http.post("/v2/batch-completions", json=request(s3_stack, content=chat_items(12)))
    assert r.status_code == 200, r.text
    job = r.json()
    assert job["status"] in ("queued", "running") and job["metadata"] == {"team": "e2e"}
    done = wait_job(s3_stack, job["job_id"], {"completed", "failed", "cancelled"})
    assert done["status"] == "completed" and done["completed_at"], done
    check_output(s3_stack, done, 12)


def test_an_s3_input_runs_to_an_output_object_in_order(s3_stack: S3Stack) -> None:
    key = f"in/{secrets.token_hex(4)}.json"
    s3_stack.moto.client().put_object(Bucket=BUCKET, Key=key, Body=json.dumps(chat_items(20)).encode())
    r = s3_stack.http.post(
        "/v2/batch-completions", json=request(s3_stack, input_data_path=f"s3://{BUCKET}/{key}")
    )
    assert r.status_code == 200, r.text
    done = wait_job(s3_stack, r.json()["job_id"], {"completed", "failed", "cancelled"})
    assert done["status"] == "completed" and done["input_data_path"] == f"s3://{BUCKET}/{key}", done
    check_output(s3_stack, done, 20)


def test_cancel_keeps_finished_items_and_marks_the_rest(s3_stack: S3Stack) -> None:
    items = [{**item, "max_tokens": 120, "ignore_eos": True} for item in chat_items(600)]
    job = s3_stack.http.post("/v2/batch-completions", json=request(s3_stack, content=items)).json()
    deadline = time.monotonic() + 180
    while s3_stack.http.get(f"/v1/batches/{job['job_id']}").json()["request_counts"]["completed"] < 20:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert s3_stack.http.get(f"/v2/batch-completions/{job['job_id']}").json()["job"]["status"] == "running"
    r = s3_stack.http.post(f"/v2/batch-completions/{job['job_id']}/actions/cancel", json={})
    assert r.status_code == 200 and r.json() == {"success": True}
    assert wait_job(s3_stack, job["job_id"], {"cancelled"})["status"] == "cancelled"
    # The output is still written, once the batch has ended: an entry per item, in order.
    deadline = time.monotonic() + 60
    while (
        exported := s3_stack.http.get(f"/v1/batches/{job['job_id']}").json()["x_output_exported_at"]
    ) is None:
        assert time.monotonic() < deadline
        time.sleep(0.5)
    output = s3_stack.read(job["output_data_path"])
    assert len(output) == 600 and exported
    cancelled = [x for x in output if x.get("code") == "batch_cancelled"]
    finished = [x for x in output if x.get("object") == "chat.completion"]
    assert cancelled and len(finished) >= 20 and len(cancelled) + len(finished) == 600


# Scale's client in its own environment (scripts/scale-client.sh, shared with
# tests/integration/test_text_completions.py).
CLIENT_PYTHON = ROOT / ".venv-llmengine" / "bin" / "python"


@pytest.fixture(scope="module")
def scale_client() -> Path:
    subprocess.run(["bash", str(ROOT / "scripts" / "scale-client.sh")], check=True, cwd=ROOT)
    return CLIENT_PYTHON


def llmengine(stack: S3Stack, **call: Any) -> Any:
    """One call of the unchanged `llmengine` client (its own environment), against this
    stack: HTTP Basic with the key as the user name, as the client always sends."""
    env = {
        "LLM_ENGINE_BASE_PATH": stack.url + "/",
        "SCALE_API_KEY": stack.key,
        "LLM_ENGINE_DISABLE_VERSION_CHECK": "true",
        "PATH": os.environ.get("PATH", ""),
    }
    done = subprocess.run(
        [str(CLIENT_PYTHON), str(ROOT / "tests" / "llmengine_driver.py"), json.dumps(call)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def client_wait(stack: S3Stack, job_id: str, until: set[str], timeout: float = 240) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        job = llmengine(stack, call="get", job_id=job_id)["job"]
        if job["status"] in until:
            return dict(job)
        assert time.monotonic() < deadline, job
        time.sleep(1)


def test_the_unchanged_llmengine_client(s3_stack: S3Stack, scale_client: Path) -> None:
    """`Completion.batch_create(use_v2=True)` with inline chat content and with an s3://
    input of completion requests, `get_batch_completion` until done, and cancel."""
    base = {"call": "batch_create", "model": E2E_MODEL, "labels": {"via": "llmengine"}}
    inline = llmengine(
        s3_stack,
        **base,
        output_data_path=f"s3://{BUCKET}/client/{secrets.token_hex(4)}.json",
        content=chat_items(6),
    )
    assert inline["status"] in ("queued", "running") and inline["metadata"] == {"via": "llmengine"}
    key = f"client/in-{secrets.token_hex(4)}.json"
    prompts = [{"prompt": f"Once upon a time {i}", "max_tokens": 4} for i in range(7)]
    s3_stack.moto.client().put_object(Bucket=BUCKET, Key=key, Body=json.dumps(prompts).encode())
    from_s3 = llmengine(
        s3_stack,
        **base,
        output_data_path=f"s3://{BUCKET}/client/{secrets.token_hex(4)}.json",
        input_data_path=f"s3://{BUCKET}/{key}",
    )
    done = client_wait(s3_stack, inline["job_id"], {"completed", "failed", "cancelled"})
    assert done["status"] == "completed", done
    check_output(s3_stack, done, 6)
    done = client_wait(s3_stack, from_s3["job_id"], {"completed", "failed", "cancelled"})
    assert done["status"] == "completed", done
    output = s3_stack.read(done["output_data_path"])
    assert len(output) == 7 and all(x["object"] == "text_completion" for x in output), output
    long = [{**x, "max_tokens": 120, "ignore_eos": True} for x in chat_items(600)]
    running = llmengine(
        s3_stack, **base, output_data_path=f"s3://{BUCKET}/client/{secrets.token_hex(4)}.json", content=long
    )
    assert llmengine(s3_stack, call="cancel", job_id=running["job_id"]) == {"success": True}
    assert client_wait(s3_stack, running["job_id"], {"cancelled"})["status"] == "cancelled"


def test_an_openai_batch_reads_and_writes_s3(s3_stack: S3Stack) -> None:
    """The openai SDK, unchanged: an s3:// JSONL object as `input_file_id`, the output
    written to `x_output_data_path` (sent as `extra_body`), every line in input order."""
    import openai

    from tests.helpers import lines, wait_batch

    client = openai.OpenAI(base_url=f"{s3_stack.url}/v1", api_key=s3_stack.key, max_retries=0)
    key = f"openai/in-{secrets.token_hex(4)}.jsonl"
    s3_stack.moto.client().put_object(Bucket=BUCKET, Key=key, Body=lines(E2E_MODEL, 25))
    target = f"s3://{BUCKET}/openai/out-{secrets.token_hex(4)}.jsonl"
    batch = client.batches.create(
        input_file_id=f"s3://{BUCKET}/{key}",
        endpoint="/v1/chat/completions",
        completion_window="24h",
        extra_body={"x_output_data_path": target},
    )
    assert batch.status == "in_progress" and batch.request_counts and batch.request_counts.total == 25
    assert wait_batch(client, batch.id).status == "completed"
    deadline = time.monotonic() + 60
    while (done := s3_stack.http.get(f"/v1/batches/{batch.id}").json())["x_output_exported_at"] is None:
        assert time.monotonic() < deadline, done
        time.sleep(0.5)
    bucket, _, name = target.removeprefix("s3://").partition("/")
    body = s3_stack.moto.client().get_object(Bucket=bucket, Key=name)["Body"].read()
    out = [json.loads(x) for x in body.splitlines()]
    assert [x["custom_id"] for x in out] == [f"line-{i}" for i in range(25)]
    assert all(x["response"]["status_code"] == 200 for x in out)
