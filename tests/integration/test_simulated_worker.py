"""A worker on the simulated GPU engine (`LLMQ_ENGINE=simulated`) serving a made-up model
name with no model folder, end to end through the real API, Postgres, Redis and Celery:
the engine fleet tests and the B7 benchmark stand on."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers import ApiProcess, Stack, Stores, WorkerProcess, events, run_many, stack_env, wait_for

pytestmark = pytest.mark.integration

SERVED = "made-up-sim-70b"


@pytest.fixture(scope="module")
def sim_stack(stores: Stores, logs_dir: Path, services) -> Iterator[Stack]:  # type: ignore[no-untyped-def]
    env = stack_env(
        stores,
        Path(SERVED),  # a name, not a folder: nothing is loaded
        SERVED,
        LLMQ_ENGINE="simulated",
        LLMQ_MAX_NUM_SEQS="4",
        LLMQ_SIM_STEP_MS="5",
        LLMQ_SIM_STEP_MS_PER_SEQ="1",
    )
    worker = WorkerProcess(env, logs_dir / "sim-worker.log").start(timeout=60)
    api = ApiProcess(env, logs_dir / "sim-api.log")
    key = services.keys.create_key("tenant-sim")
    try:
        yield Stack(api.url, key, SERVED, worker, env)
    finally:
        api.stop()
        worker.stop()


def chat(content: str, **fields: object) -> dict[str, object]:
    return {"model": SERVED, "messages": [{"role": "user", "content": content}], **fields}


def test_jobs_run_to_max_tokens_with_usage_and_deterministic_text(sim_stack: Stack) -> None:
    jobs = run_many(
        sim_stack,
        [
            chat("Tell me something.", max_tokens=7, seed=11),
            chat("Tell me something.", max_tokens=7, seed=11),
            chat("Tell me something.", max_tokens=7, seed=12),
            chat("Tell me something.", max_tokens=3, n=2, seed=11),
        ],
    )
    assert [j["status"] for j in jobs] == ["succeeded"] * 4, jobs
    texts = [j["response"]["choices"][0]["message"]["content"] for j in jobs]
    assert len(texts[0].split()) == 7
    assert texts[0] == texts[1] != texts[2]
    # The first three tokens of the same prompt and seed: the same words.
    assert texts[3].split() == texts[0].split()[:3]
    first = jobs[0]["response"]
    assert first["choices"][0]["finish_reason"] == "length"
    assert first["usage"]["completion_tokens"] == 7
    assert first["usage"]["prompt_tokens"] == len(b"Tell me something.")  # bytes of the text
    assert first["model"] == SERVED
    assert first["system_fingerprint"].startswith("fp_simulated-1-")
    wide = jobs[3]["response"]
    assert [c["finish_reason"] for c in wide["choices"]] == ["length", "length"]
    assert wide["choices"][0]["message"]["content"] != wide["choices"][1]["message"]["content"]
    assert wide["usage"]["completion_tokens"] == 6


def test_a_stop_string_ends_the_answer_before_it(sim_stack: Stack) -> None:
    (full,) = run_many(sim_stack, [chat("Stop somewhere.", max_tokens=12, seed=5)])
    text = full["response"]["choices"][0]["message"]["content"]
    stop = text.split()[5]
    (cut,) = run_many(sim_stack, [chat("Stop somewhere.", max_tokens=12, seed=5, stop=[stop])])
    choice = cut["response"]["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["content"] == text[: text.find(stop)]
    assert cut["response"]["usage"]["completion_tokens"] < 12


def test_streaming_deltas_add_up_to_the_stored_answer(sim_stack: Stack) -> None:
    body = chat("Stream this.", max_tokens=9, seed=3)
    (stored,) = run_many(sim_stack, [body])
    with (
        httpx.Client(base_url=sim_stack.url, headers={"Authorization": f"Bearer {sim_stack.key}"}) as c,
        c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r,
    ):
        assert r.status_code == 200
        chunks = [e.json for e in events(r) if not e.done]
    deltas = [ch["choices"][0]["delta"].get("content") or "" for ch in chunks if ch["choices"]]
    assert len([d for d in deltas if d]) > 1  # it arrived in pieces
    assert "".join(deltas) == stored["response"]["choices"][0]["message"]["content"]
    assert [ch["choices"][0]["finish_reason"] for ch in chunks if ch["choices"]][-1] == "length"


def test_a_cancelled_job_keeps_its_partial_text(sim_stack: Stack) -> None:
    with sim_stack.client() as c:
        job_id = c.post("/v2/jobs", json=chat("A long one.", max_tokens=3000)).json()["id"]
        with c.stream("GET", f"/v2/jobs/{job_id}/stream") as stream:
            first = next(e for e in events(stream) if not e.done and e.json.get("choices"))
        assert first.json["choices"][0]["delta"].get("content")
        assert c.post(f"/v2/jobs/{job_id}/cancel").status_code == 200
        job = wait_for(c, [job_id], timeout=60)[job_id]
    assert job["status"] == "cancelled"
    choice = job["response"]["choices"][0]
    assert choice["message"]["content"] and choice["finish_reason"] == "error"
    assert 0 < job["usage"]["completion_tokens"] < 3000
