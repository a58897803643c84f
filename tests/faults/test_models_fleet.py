"""Two models behind one API (issue 11 items 1-2), on instant-engine workers: each model's
jobs run only on its own workers, a model with a live worker is served without being
declared, and one model's batch spreads over all of its workers, one that joins mid-batch
included."""

from __future__ import annotations

import time
from collections import Counter

import pytest
from sqlalchemy import text

from tests.faults.conftest import MODEL, FaultStack
from tests.helpers import auth

pytestmark = pytest.mark.faults

OTHER = "other-model"  # served by a live worker only: not declared anywhere
SMALL = {"LLMQ_MAX_NUM_SEQS": "8"}  # capacity 16 a worker: chunks of 4, a window of 24 each


def finished_by(stack: FaultStack, ids: list[str]) -> dict[str, str]:
    with stack.services.db.session() as s:
        rows = s.execute(
            text("SELECT id, finished_by FROM jobs WHERE id = ANY(:ids) AND status = 'succeeded'"),
            {"ids": ids},
        ).all()
    return {r.id: r.finished_by for r in rows}


def wait_jobs(stack: FaultStack, ids: list[str], timeout: float = 60) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while len(done := finished_by(stack, ids)) < len(ids):
        assert time.monotonic() < deadline, f"{len(done)} of {len(ids)} jobs done"
        time.sleep(0.2)
    return done


def name_of(worker) -> str:  # type: ignore[no-untyped-def]
    return f"llmq-{worker.proc.pid}@"


def test_two_models_run_on_their_own_workers_and_a_batch_spreads_over_its_models(
    fault_stack: FaultStack,
) -> None:
    a1 = fault_stack.worker("models-a1", **SMALL)
    b1 = fault_stack.worker("models-b1", LLMQ_SERVED_MODEL_NAME=OTHER, **SMALL)
    time.sleep(fault_stack.services.settings.model_registry_ttl_seconds)
    cards = {
        c["id"]: c
        for c in fault_stack.client.get("/v1/models", headers=auth(fault_stack.key)).get_json()["data"]
    }
    assert (cards[MODEL]["live"], cards[OTHER]["live"], cards[OTHER]["declared"]) == (True, True, False)

    ids: dict[str, list[str]] = {MODEL: [], OTHER: []}
    for model, job_ids in ids.items():
        for i in range(6):
            body = {"model": model, "messages": [{"role": "user", "content": f"job {i}"}], "max_tokens": 5}
            r = fault_stack.client.post("/v2/jobs", json=body, headers=auth(fault_stack.key))
            assert r.status_code == 202, r.get_json()
            job_ids.append(r.get_json()["id"])
    ran = {model: set(wait_jobs(fault_stack, job_ids).values()) for model, job_ids in ids.items()}
    assert all(w.startswith(name_of(a1)) for w in ran[MODEL]), ran
    assert all(w.startswith(name_of(b1)) for w in ran[OTHER]), ran

    # A batch of MODEL's: a second worker of MODEL joins mid-batch and takes its share.
    batch = fault_stack.batch(400, max_tokens=40)  # 0.4 s a line, 16 at once a worker
    fault_stack.wait_rows(batch, "status = 'succeeded'", 40)
    a2 = fault_stack.worker("models-a2", **SMALL)
    joined = time.monotonic()
    deadline = joined + 10
    while not any(w.startswith(name_of(a2)) for w in finished_by_batch(fault_stack, batch).values()):
        assert time.monotonic() < deadline, "the worker that joined mid-batch took no line within 10 s"
        time.sleep(0.2)
    done = fault_stack.wait_batch(batch, timeout=180)
    assert done["status"] == "completed", fault_stack.describe(batch)
    fault_stack.inv(batch, 400)
    per_worker = Counter(w.split("@")[0] + "@" for w in finished_by_batch(fault_stack, batch).values())
    assert per_worker[name_of(b1)] == 0  # the other model's worker never takes MODEL's lines
    assert per_worker[name_of(a1)] + per_worker[name_of(a2)] == 400
    assert per_worker[name_of(a2)] >= 80, per_worker  # a real share, though it came late


def finished_by_batch(stack: FaultStack, batch_id: str) -> dict[str, str]:
    return {k: str(v["finished_by"]) for k, v in stack.rows(batch_id, "status = 'succeeded'").items()}
