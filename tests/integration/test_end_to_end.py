"""One job and many, end to end: API → Postgres → Redis → Celery worker → vLLM → Postgres."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from sqlalchemy import text

from app.schemas.chat import ChatCompletionV2Request
from app.schemas.completion import ChatCompletion, GenerationStats
from app.schemas.jobs import JobObject
from tests.helpers import Stack, events, pick_stop, submit_unchecked, wait_for

pytestmark = pytest.mark.integration


def body(stack: Stack, **fields) -> dict:
    return {"model": stack.model, "messages": [{"role": "user", "content": "Tell me a story."}], **fields}


def submit(stack: Stack, **fields) -> str:
    with stack.client() as c:
        r = c.post("/v2/jobs", json=body(stack, **fields))
        assert r.status_code == 202, r.text
        return str(r.json()["id"])


def run(stack: Stack, **fields) -> dict:
    job_id = submit(stack, **fields)
    with stack.client() as c:
        return wait_for(c, [job_id])[job_id]


def test_one_job_carries_completion_usage_and_measured_stats(stack: Stack) -> None:
    job = run(stack, max_tokens=24, ignore_eos=True)
    JobObject.model_validate(job)
    assert job["status"] == "succeeded", job
    completion = ChatCompletion.model_validate(job["response"])
    assert completion.object == "chat.completion"
    assert completion.id.startswith("chatcmpl-")
    assert completion.model == stack.model
    assert completion.system_fingerprint and completion.system_fingerprint.startswith("fp_vllm-0.32")
    assert completion.choices[0].message.role == "assistant"
    assert completion.choices[0].message.content
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None and completion.usage.completion_tokens == 24
    assert completion.usage.prompt_tokens > 5
    assert job["usage"] == job["response"]["usage"]
    stats = GenerationStats.model_validate(job["generation_stats"])
    assert stats.generation_tokens == 24
    assert stats.prompt_tokens == completion.usage.prompt_tokens
    assert stats.generation_tps > 1 and stats.prompt_tps > 1
    assert stats.peak_memory_usage.inBytes > 200 * 2**20  # worker + engine processes on CPU
    assert job["power_usage"] is None  # no sensor on a CPU worker
    assert job["attempts"] == 1 and job["epoch"] == 1
    assert job["started_at"] and job["succeeded_at"]


def test_the_workers_threads_carry_their_names_to_the_kernel(stack: Stack) -> None:
    """What `top -H` and `ps -L` show, and bench/cpu.py cuts the worker's CPU by: the
    engine's loop, Celery's task threads (once one has run a job), the stream publisher and
    the periodic threads under their own names; the main thread keeps the process's."""
    assert run(stack, max_tokens=4)["status"] == "succeeded"
    assert stack.worker.proc is not None
    tasks = Path(f"/proc/{stack.worker.proc.pid}/task")
    names = {(tasks / tid / "comm").read_text().strip() for tid in os.listdir(tasks)}
    assert {"llmq-engine-loo", "llmq-task", "llmq-stream-pub", "llmq-sweeper", "llmq-batches"} <= names
    main = (tasks / str(stack.worker.proc.pid) / "comm").read_text().strip()
    assert not main.startswith("llmq-"), main


def test_max_tokens_gives_length_and_exact_count(stack: Stack) -> None:
    job = run(stack, max_tokens=7, ignore_eos=True)
    assert job["response"]["choices"][0]["finish_reason"] == "length"
    assert job["usage"]["completion_tokens"] == 7
    job = run(stack, max_completion_tokens=5, max_tokens=50, ignore_eos=True)
    assert job["usage"]["completion_tokens"] == 5


def test_same_seed_same_text_and_n_choices(stack: Stack) -> None:
    a = run(stack, max_tokens=16, temperature=1.0, seed=1234)
    b = run(stack, max_tokens=16, temperature=1.0, seed=1234)
    c = run(stack, max_tokens=16, temperature=1.0, seed=999)
    text = lambda j: j["response"]["choices"][0]["message"]["content"]  # noqa: E731
    assert text(a) == text(b)
    assert text(a) != text(c)
    many = run(stack, max_tokens=8, n=3, temperature=1.0, seed=5, ignore_eos=True)
    assert [ch["index"] for ch in many["response"]["choices"]] == [0, 1, 2]
    assert many["usage"]["completion_tokens"] == 24


def test_greedy_is_deterministic_and_stop_strings_cut_the_text(stack: Stack) -> None:
    base = run(stack, max_tokens=32, temperature=0, ignore_eos=True)
    full = base["response"]["choices"][0]["message"]["content"]
    assert (
        run(stack, max_tokens=32, temperature=0, ignore_eos=True)["response"]["choices"][0]["message"][
            "content"
        ]
        == full
    )
    # Stop on a piece of a (seeded, so reproducible) text: the output ends right before it.
    seeded = {"temperature": 1.0, "seed": 11, "max_tokens": 32}
    sampled = run(stack, ignore_eos=True, **seeded)["response"]["choices"][0]["message"]["content"]
    cut = pick_stop(sampled)
    stopped = run(stack, stop=[cut], **seeded)
    text = stopped["response"]["choices"][0]["message"]["content"]
    assert sampled.startswith(text + cut)
    assert stopped["response"]["choices"][0]["finish_reason"] == "stop"


def test_sampling_knobs_change_the_output(stack: Stack) -> None:
    greedy = run(stack, max_tokens=24, temperature=0, ignore_eos=True)["response"]["choices"][0]["message"][
        "content"
    ]
    for knobs in (
        {"temperature": 1.5, "seed": 3},
        {"temperature": 1.0, "top_k": 50, "seed": 3},
        {"temperature": 1.0, "top_p": 0.95, "seed": 3},
        {"temperature": 1.0, "min_p": 0.01, "seed": 3},
    ):
        out = run(stack, max_tokens=24, ignore_eos=True, **knobs)
        assert out["status"] == "succeeded", knobs
        assert out["response"]["choices"][0]["message"]["content"] != greedy, knobs
    # top_k=1 is greedy whatever the temperature
    topk1 = run(stack, max_tokens=24, temperature=1.5, top_k=1, seed=3, ignore_eos=True)
    assert topk1["response"]["choices"][0]["message"]["content"] == greedy


def test_eight_concurrent_jobs_are_batched_continuously(stack: Stack, services) -> None:
    # Queued through the service layer (the API's own code minus HTTP), so all eight are in
    # the queue within milliseconds: on two cores a busy engine can delay HTTP by seconds.
    principal = services.keys.authenticate(stack.key)
    sizes = [512, 704, 896, 1088, 1280, 1472, 1664, 1856]
    ids = [
        services.jobs.submit_request(
            principal,
            ChatCompletionV2Request.model_validate(body(stack, max_tokens=n, ignore_eos=True, temperature=0)),
        ).id
        for n in sizes
    ]
    with stack.client() as c:
        jobs = wait_for(c, ids)
    assert all(j["status"] == "succeeded" for j in jobs.values())
    assert [jobs[i]["usage"]["completion_tokens"] for i in ids] == sizes
    with services.db.session() as s:
        rows = s.execute(
            text("SELECT id, started_at, succeeded_at FROM jobs WHERE id = ANY(:ids)"), {"ids": ids}
        ).all()
    # All eight were running in the engine at once: every job started before any finished.
    assert max(r.started_at for r in rows) < min(r.succeeded_at for r in rows)
    wall = (max(r.succeeded_at for r in rows) - min(r.started_at for r in rows)).total_seconds()
    busy = sum((r.succeeded_at - r.started_at).total_seconds() for r in rows)
    # Average number of jobs in the engine at once; 1.0 would mean one after another.
    assert busy / wall > 3, f"wall {wall:.2f}s, sum of per-job times {busy:.2f}s"


def test_cancel_running_job_keeps_partial_text(stack: Stack) -> None:
    job_id = submit(stack, max_tokens=1900, ignore_eos=True)
    with stack.client() as c:
        deadline = time.monotonic() + 60
        while c.get(f"/v2/jobs/{job_id}").json()["status"] != "running":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        # Cancel once some text exists (the first streamed chunk), so there is some to keep.
        with c.stream("GET", f"/v2/jobs/{job_id}/stream") as stream:
            first = next(e for e in events(stream) if not e.done and e.json.get("choices"))
        assert first.json["choices"][0]["delta"].get("content")
        r = c.post(f"/v2/jobs/{job_id}/cancel")
        assert r.status_code == 200
        job = wait_for(c, [job_id])[job_id]
    assert job["status"] == "cancelled"
    assert job["cancelled_at"] is not None
    content = job["response"]["choices"][0]["message"]["content"]
    assert content and job["response"]["choices"][0]["finish_reason"] == "error"
    assert 0 < job["usage"]["completion_tokens"] < 1900
    # A finished job cannot be cancelled.
    done = run(stack, max_tokens=2)
    with stack.client() as c:
        r = c.post(f"/v2/jobs/{done['id']}/cancel")
    assert r.status_code == 409 and r.json()["error"]["code"] == "job_not_cancellable"


def test_prompt_over_context_is_a_400_or_fails_that_job_alone(stack: Stack, services) -> None:
    long = body(stack, messages=[{"role": "user", "content": "word " * 3000}], max_tokens=4)
    with stack.client() as c:
        r = c.post("/v2/jobs", json=long)
    # The API counts tokens with the model's tokenizer: refused before anything is stored.
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    # Past the API (as a batch line is), the worker fails that job alone with the same body.
    job_id = submit_unchecked(services, stack, long)
    with stack.client() as c:
        job = wait_for(c, [job_id])[job_id]
    assert job["status"] == "failed"
    assert job["error"]["code"] == "context_length_exceeded"
    assert job["error"]["type"] == "invalid_request_error"
    assert run(stack, max_tokens=3)["status"] == "succeeded"


def test_readyz_sees_the_consuming_worker(stack: Stack) -> None:
    with stack.client() as c:
        ready = c.get("/readyz")
    assert ready.status_code == 200
    assert ready.json()["checks"]["workers"]["consuming"] >= 1


def test_the_worker_registers_its_model_with_the_engines_context_length(stack: Stack) -> None:
    with stack.client() as c:
        cards = {m["id"]: m for m in c.get("/v1/models").json()["data"]}
    tiny = cards[stack.model]
    assert (tiny["live"], tiny["workers"], tiny["declared"]) == (True, 1, True)
    assert tiny["max_model_len"] == 2048  # what the vLLM engine reports for the tiny model


def test_logs_hold_no_key_and_no_prompt(stack: Stack) -> None:
    """Whatever passes through API and worker at INFO, the prompt text and the key do not
    reach their logs (a wrong key that looks real included)."""
    secret = f"prompt-secret-{time.time_ns()}"
    job = run(stack, messages=[{"role": "user", "content": secret}], max_tokens=4)
    assert job["status"] == "succeeded"
    lookalike = stack.key[:-6] + "abcdef"
    with stack.client() as c:
        c.headers["Authorization"] = f"Bearer {lookalike}"
        assert c.get("/v2/jobs").status_code == 401
        c.headers["Authorization"] = f"Bearer {secret}"
        assert (
            c.post("/v2/jobs", json=body(stack, messages=[{"role": "user", "content": secret}])).status_code
            == 401
        )

    def logs() -> str:
        return "".join(p.read_text(errors="replace") for p in stack.worker.log_path.parent.glob("*.log"))

    # Wait for the worker's line about the job itself (logged at INFO) to be written.
    deadline = time.monotonic() + 10
    while job["id"] not in logs():
        assert time.monotonic() < deadline, "the job was never logged"
        time.sleep(0.05)
    # The refused requests were answered before; the API logs synchronously.
    written = logs()
    for needle in (secret, stack.key, lookalike, stack.key[12:]):
        assert needle not in written, needle
