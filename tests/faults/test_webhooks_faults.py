"""W1: webhooks survive restarts. Events are written with the changes that cause them, so
none is lost when the API and the delivering worker die: a receiver that is down while
jobs and a batch end, while the worker is killed with SIGKILL and the API restarted, gets
every event, signed so that both the `openai` SDK and `standardwebhooks` verify it, once
it is back."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx
import openai
import pytest
import standardwebhooks
from sqlalchemy import text

from app.cli.main import main
from tests.faults.conftest import MODEL, FaultStack
from tests.helpers import ApiProcess, stack_env
from tests.webhook_receiver import Receiver

FAST_RETRIES = {
    "LLMQ_WEBHOOK_ALLOW_PRIVATE": "true",
    "LLMQ_WEBHOOK_RETRY_BASE_SECONDS": "0.5",
    "LLMQ_WEBHOOK_RETRY_CAP_SECONDS": "2",
    "LLMQ_WEBHOOK_POLL_SECONDS": "0.2",
    "LLMQ_WEBHOOK_CONNECT_TIMEOUT_SECONDS": "1",
    "LLMQ_WEBHOOK_TIMEOUT_SECONDS": "2",
}


def _api(fault_stack: FaultStack, name: str) -> ApiProcess:
    env = stack_env(fault_stack.stores, Path(MODEL), MODEL, **FAST_RETRIES)
    env["LLMQ_MODEL"] = MODEL
    return ApiProcess(env, fault_stack.logs / f"{name}.log")


def _outbox(fault_stack: FaultStack) -> dict[str, tuple[str, int]]:
    with fault_stack.services.db.session() as s:
        rows = s.execute(text("SELECT event_id, status, attempts FROM webhook_deliveries")).all()
    return {r.event_id: (r.status, r.attempts) for r in rows}


def test_w1_no_event_lost_across_api_and_worker_restarts_while_the_receiver_is_down(
    fault_stack: FaultStack, capsys: pytest.CaptureFixture[str]
) -> None:
    receiver = Receiver()  # down: nothing listens on its port yet
    api = _api(fault_stack, "api-1")
    headers = {"Authorization": f"Bearer {fault_stack.key}"}
    with httpx.Client(base_url=api.url, headers=headers, timeout=30) as c:
        r = c.post(
            "/v1/webhook_endpoints",
            json={"url": receiver.url, "event_types": ["batch.completed", "job.succeeded", "job.cancelled"]},
        )
        assert r.status_code == 200, r.text
        hook = r.json()
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
        jobs = [c.post("/v2/jobs", json=body).json()["id"] for _ in range(4)]
        cancelled = c.post("/v2/jobs", json=body).json()["id"]
        assert c.post(f"/v2/jobs/{cancelled}/cancel").json()["status"] == "cancelled"
    batch = fault_stack.batch(6, max_tokens=5)

    worker = fault_stack.worker("w1-a", **FAST_RETRIES)
    assert fault_stack.wait_batch(batch, timeout=60)["status"] == "completed"
    expected = 4 + 1 + 1
    deadline = time.monotonic() + 30
    while not (len(outbox := _outbox(fault_stack)) == expected and all(a >= 2 for _, a in outbox.values())):
        assert time.monotonic() < deadline, outbox
        time.sleep(0.2)
    assert all(status == "pending" for status, _ in outbox.values())

    # The deliverer dies mid-retry, the API restarts; the receiver is still down.
    worker.kill(signal.SIGKILL)
    api.stop()
    api = _api(fault_stack, "api-2")
    fault_stack.worker("w1-b", **FAST_RETRIES)
    time.sleep(3)
    receiver.start()
    try:
        deadline = time.monotonic() + 60
        while len(receiver.event_ids()) < expected:
            assert time.monotonic() < deadline, (receiver.event_ids(), _outbox(fault_stack))
            time.sleep(0.2)
    finally:
        receiver.stop()

    sdk = openai.OpenAI(api_key="unused", base_url="http://127.0.0.1:9/v1")
    subjects = set()
    for got in receiver.snapshot():
        event = standardwebhooks.Webhook(hook["signing_secret"]).verify(got.body, got.headers)
        sdk.webhooks.unwrap(got.body, got.headers, secret=hook["signing_secret"])
        subjects.add((event["type"], event["data"]["id"]))
    assert subjects == {("job.succeeded", j) for j in jobs} | {
        ("job.cancelled", cancelled),
        ("batch.completed", batch),
    }
    deadline = time.monotonic() + 10
    while any(status != "delivered" for status, _ in _outbox(fault_stack).values()):
        assert time.monotonic() < deadline, _outbox(fault_stack)
        time.sleep(0.2)

    # What the API and `llmq webhooks deliveries` show after the restarts.
    try:
        with httpx.Client(base_url=api.url, headers=headers, timeout=30) as c:
            listed = c.get(f"/v1/webhook_endpoints/{hook['id']}/deliveries", params={"limit": 100}).json()
        assert {d["status"] for d in listed["data"]} == {"delivered"} and len(listed["data"]) == expected
        assert all(d["attempts"] >= 3 for d in listed["data"])
        assert main(["webhooks", "deliveries", hook["id"], "--url", api.url, "--key", fault_stack.key]) == 0
        shown = capsys.readouterr().out.splitlines()
        assert len(shown) == expected and all(" delivered " in row for row in shown)
    finally:
        api.stop()
