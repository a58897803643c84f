"""Batches end to end on the real stack: the openai SDK's whole flow, per-line failures,
cancel and expiry keeping finished work, and a worker killed half way."""

from __future__ import annotations

import io
import json
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from openai.types.chat import ChatCompletion as SdkChatCompletion
from sqlalchemy import text

from app.api import create_app
from app.container import build_services
from tests.helpers import Stack, Stores, WorkerProcess, auth, lines, make_settings, sdk, stack_env, wait_batch

pytestmark = pytest.mark.integration


def check_inv(services, batch_id: str, n: int, output: list[dict], errors: list[dict]) -> None:  # type: ignore[no-untyped-def]
    """INV: n rows with distinct line numbers; every custom_id exactly once across both files."""
    with services.db.session() as s:
        rows = s.execute(
            text("SELECT count(*), count(DISTINCT line_no) FROM jobs WHERE batch_id = :b"), {"b": batch_id}
        ).one()
    assert tuple(rows) == (n, n)
    ids = [x["custom_id"] for x in output + errors]
    assert sorted(ids) == sorted(f"line-{i}" for i in range(n))


def test_openai_sdk_whole_flow_with_poison_lines(stack: Stack, services) -> None:
    client = sdk(stack)
    poison = {3, 101, 202, 303, 404, 505, 606, 707, 808, 909}
    uploaded = client.files.create(
        file=("in.jsonl", io.BytesIO(lines(stack.model, 1000, poison=poison))), purpose="batch"
    )
    assert uploaded.purpose == "batch" and uploaded.bytes > 0
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert batch.status == "in_progress" and batch.request_counts and batch.request_counts.total == 1000
    done = wait_batch(client, batch.id)
    assert done.status == "completed", done
    assert done.request_counts and (done.request_counts.completed, done.request_counts.failed) == (990, 10)
    assert done.output_file_id and done.error_file_id and done.completed_at and done.finalizing_at
    assert done.usage and 990 <= done.usage.output_tokens <= 990 * 4
    output = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    errors = [json.loads(x) for x in client.files.content(done.error_file_id).text.splitlines()]
    assert len(output) == 990 and len(errors) == 10
    assert [x["custom_id"] for x in output] == [
        f"line-{i}" for i in range(1000) if i not in poison
    ]  # input order
    for x in output:
        assert x["error"] is None and x["response"]["status_code"] == 200
        SdkChatCompletion.model_validate(x["response"]["body"])
    for x in errors:
        assert x["response"]["status_code"] == 400
        assert x["response"]["body"]["error"]["code"] == "context_length_exceeded"
    check_inv(services, batch.id, 1000, output, errors)
    listed = client.batches.list(limit=5)
    assert batch.id in [b.id for b in listed.data]
    assert client.files.retrieve(done.output_file_id).purpose == "batch_output"
    # Each line is a job, pollable by its id.
    with stack.client() as c:
        job = c.get(f"/v2/jobs/{output[0]['response']['request_id']}").json()
    assert job["batch_id"] == batch.id and job["custom_id"] == "line-0" and job["status"] == "succeeded"
    assert job["response"] == output[0]["response"]["body"]


def test_cancel_half_way_keeps_the_finished_half(stack: Stack, services) -> None:
    client = sdk(stack)
    uploaded = client.files.create(
        file=("c.jsonl", io.BytesIO(lines(stack.model, 600, max_tokens=120, ignore_eos=True))),
        purpose="batch",
    )
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    deadline = time.monotonic() + 180
    while client.batches.retrieve(batch.id).request_counts.completed < 150:  # type: ignore[union-attr]
        assert time.monotonic() < deadline
        time.sleep(0.2)
    with services.db.session() as s:
        before = dict(
            s.execute(
                text("SELECT id, succeeded_at FROM jobs WHERE batch_id = :b AND status = 'succeeded'"),
                {"b": batch.id},
            ).all()
        )
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = wait_batch(client, batch.id, timeout=120)
    assert done.status == "cancelled" and done.cancelled_at
    with services.db.session() as s:
        after = dict(
            s.execute(
                text("SELECT id, succeeded_at FROM jobs WHERE batch_id = :b AND status = 'succeeded'"),
                {"b": batch.id},
            ).all()
        )
        active = s.execute(
            text("SELECT count(*) FROM jobs WHERE batch_id = :b AND status IN ('queued', 'running')"),
            {"b": batch.id},
        ).scalar()
    assert active == 0
    assert {k: after[k] for k in before} == before  # finished lines untouched
    assert len(after) < 600
    output = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]  # type: ignore[arg-type]
    errors = [json.loads(x) for x in client.files.content(done.error_file_id).text.splitlines()]  # type: ignore[arg-type]
    assert len(output) == len(after)
    assert all(x["response"] is None and x["error"]["code"] == "batch_cancelled" for x in errors)
    check_inv(services, batch.id, 600, output, errors)
    # No line finishes after the cancel was acknowledged: wait until no worker holds a
    # message naming one of its lines (acknowledged once its task ended, fenced or not).
    with services.db.session() as s:
        lines_ = set(s.scalars(text("SELECT id FROM jobs WHERE batch_id = :b"), {"b": batch.id}))
    deadline = time.monotonic() + 60
    while lines_ & services.liveness.delivered_job_ids():
        assert time.monotonic() < deadline, "a worker still holds lines of the cancelled batch"
        time.sleep(0.2)
    with services.db.session() as s:
        assert s.execute(
            text("SELECT count(*) FROM jobs WHERE batch_id = :b AND status = 'succeeded'"), {"b": batch.id}
        ).scalar() == len(after)


def test_expiry_keeps_finished_work(stack: Stack, services) -> None:
    client = sdk(stack)
    # 40 short lines finish first; 260 long ones are still running or waiting when the
    # window ends (with every line in flight at once, equal lines would all end together).
    data = b"".join(
        json.dumps({**line, "custom_id": f"line-{i}"}).encode() + b"\n"
        for i, line in enumerate(
            [json.loads(x) for x in lines(stack.model, 40, max_tokens=4).splitlines()]
            + [json.loads(x) for x in lines(stack.model, 260, max_tokens=400, ignore_eos=True).splitlines()]
        )
    )
    uploaded = client.files.create(file=("e.jsonl", io.BytesIO(data)), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="1h"
    )
    deadline = time.monotonic() + 180
    while client.batches.retrieve(batch.id).request_counts.completed < 40:  # type: ignore[union-attr]
        assert time.monotonic() < deadline
        time.sleep(0.2)
    with services.db.session() as s:  # the window ends now
        s.execute(
            text("UPDATE batches SET expires_at = now() - interval '1 second' WHERE id = :b"), {"b": batch.id}
        )
    done = wait_batch(client, batch.id, timeout=60)
    assert done.status == "expired" and done.expired_at
    errors = [json.loads(x) for x in client.files.content(done.error_file_id).text.splitlines()]  # type: ignore[arg-type]
    output = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]  # type: ignore[arg-type]
    assert len(output) >= 40 and all(x["error"]["code"] == "batch_expired" for x in errors)
    check_inv(services, batch.id, 300, output, errors)


MODEL = "tiny-batch-crash"


def test_kill_9_worker_half_way_then_restart(stores: Stores, tiny_model: Path, logs_dir: Path) -> None:
    settings = make_settings(stores, model=str(tiny_model), served_model_name=MODEL)
    services = build_services(settings)
    client = create_app(services=services).test_client()
    key = services.keys.create_key("tenant-batch-crash")
    env = stack_env(stores, tiny_model, MODEL)
    first = WorkerProcess(env, logs_dir / "batch-crash-1.log").start()
    data = lines(MODEL, 1000, max_tokens=48, ignore_eos=True)
    f = client.post(
        "/v1/files",
        data={"purpose": "batch", "file": (io.BytesIO(data), "k.jsonl")},
        headers=auth(key),
        content_type="multipart/form-data",
    ).get_json()
    b = client.post(
        "/v1/batches",
        json={"input_file_id": f["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"},
        headers=auth(key),
    ).get_json()

    def succeeded() -> dict[str, Any]:
        with services.db.session() as s:
            return dict(
                s.execute(
                    text("SELECT id, succeeded_at FROM jobs WHERE batch_id = :b AND status = 'succeeded'"),
                    {"b": b["id"]},
                ).all()
            )

    deadline = time.monotonic() + 240
    while len(succeeded()) < 500:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    first.kill(signal.SIGKILL)
    before = succeeded()
    second = WorkerProcess(env, logs_dir / "batch-crash-2.log").start()
    try:
        deadline = time.monotonic() + 300
        while client.get(f"/v1/batches/{b['id']}", headers=auth(key)).get_json()["status"] != "completed":
            assert time.monotonic() < deadline
            time.sleep(0.5)
    finally:
        second.stop()
    done = client.get(f"/v1/batches/{b['id']}", headers=auth(key)).get_json()
    assert done["request_counts"] == {"total": 1000, "completed": 1000, "failed": 0}
    after = succeeded()
    assert {k: after[k] for k in before} == before  # not regenerated
    output = [
        json.loads(x)
        for x in client.get(f"/v1/files/{done['output_file_id']}/content", headers=auth(key))
        .data.decode()
        .splitlines()
    ]
    check_inv(services, b["id"], 1000, output, [])
    with services.db.session() as s:
        rerun = s.execute(
            text("SELECT count(*) FROM jobs WHERE batch_id = :b AND attempts > 1"), {"b": b["id"]}
        ).scalar()
    assert rerun > 0  # lines in flight at the kill ran again, once
    services.close()
