"""Structured outputs against the real stack (vLLM on the tiny model): constraints that
crash the structured-output library are 400s and never take the worker down (issue 9 item
1); `\\d` means ASCII digits over 200 seeds at temperature 1 (issue 10 defect 1)."""

from __future__ import annotations

import json
import re
import threading
import time
from typing import Any

import httpx
import pytest

from tests.bombs import chained_grammar, ref_chain_schema
from tests.helpers import Stack, submit_unchecked, wait_for

pytestmark = pytest.mark.integration


def body(stack: Stack, **fields: Any) -> dict[str, Any]:
    return {"model": stack.model, "messages": [{"role": "user", "content": "Say something."}], **fields}


def bombs() -> list[tuple[dict[str, Any], str]]:
    schema = {"type": "json_schema", "json_schema": {"name": "bomb", "schema": ref_chain_schema()}}
    return [
        ({"response_format": schema, "max_tokens": 8}, "response_format.json_schema.schema"),
        ({"guided_grammar": chained_grammar(), "max_tokens": 8}, "guided_grammar"),
    ]


def test_bombs_are_400s_while_another_tenant_runs_and_the_worker_lives(stack: Stack, services) -> None:
    assert stack.worker.proc is not None
    pid = stack.worker.proc.pid
    other = services.keys.create_key("tenant-structured-other")
    with (
        stack.client() as attacker,
        httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {other}"}, timeout=60) as victim,
    ):
        running = victim.post("/v2/jobs", json=body(stack, max_tokens=64, ignore_eos=True))
        assert running.status_code == 202
        sync: dict[str, Any] = {}

        def sync_call() -> None:
            started = time.monotonic()
            r = victim.post("/v1/chat/completions", json=body(stack, max_tokens=8))
            sync.update(status=r.status_code, seconds=time.monotonic() - started)

        caller = threading.Thread(target=sync_call)
        caller.start()
        unchecked = []
        for fields, param in bombs():
            # At the API: a 400 naming the field, before anything is queued.
            started = time.monotonic()
            r = attacker.post("/v1/chat/completions", json=body(stack, **fields))
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
            assert time.monotonic() - started < 5
            # Past the API (as a line from an older upload would be): the worker's sandbox.
            unchecked.append((submit_unchecked(services, stack, body(stack, **fields)), param))
        caller.join(60)
        assert sync.get("status") == 200 and sync["seconds"] < 10, sync
        done = wait_for(attacker, [j for j, _ in unchecked], timeout=60)
        for job_id, param in unchecked:
            job = done[job_id]
            assert job["status"] == "failed" and job["attempts"] == 1, job
            assert job["error"]["type"] == "invalid_request_error" and job["error"]["param"] == param
        victim_job = wait_for(victim, [running.json()["id"]], timeout=60)[running.json()["id"]]
        assert victim_job["status"] == "succeeded" and victim_job["attempts"] == 1
    # The same worker process served it all.
    assert stack.worker.proc.poll() is None and stack.worker.proc.pid == pid


DATE = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}")
MONTH = re.compile(r"[0-9]{4}-[0-9]{2}")


def test_backslash_d_means_ascii_digits_over_200_seeds(stack: Stack) -> None:
    schema = {
        "type": "object",
        "properties": {"month": {"type": "string", "pattern": r"^\d{4}-\d{2}$"}},
        "required": ["month"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "m", "schema": schema}}
    seeds = range(200)
    started = time.monotonic()
    with stack.client() as client:
        regex_jobs, json_jobs = [], []
        for seed in seeds:
            common = {"temperature": 1.0, "seed": seed}
            r = client.post(
                "/v2/jobs", json=body(stack, guided_regex=r"\d{4}-\d{2}-\d{2}", max_tokens=24, **common)
            )
            assert r.status_code == 202, r.text
            regex_jobs.append(r.json()["id"])
            r = client.post("/v2/jobs", json=body(stack, response_format=fmt, max_tokens=48, **common))
            assert r.status_code == 202, r.text
            json_jobs.append(r.json()["id"])
        done = wait_for(client, regex_jobs + json_jobs, timeout=180)
    bad = []
    for job_id in regex_jobs:
        job = done[job_id]
        text = job["response"]["choices"][0]["message"]["content"] if job["status"] == "succeeded" else None
        if text is None or not DATE.fullmatch(text):
            bad.append(("regex", job["status"], text))
    for job_id in json_jobs:
        job = done[job_id]
        text = job["response"]["choices"][0]["message"]["content"] if job["status"] == "succeeded" else None
        try:
            month = json.loads(text or "")["month"]
        except (ValueError, KeyError, TypeError):
            month = None
        if month is None or not MONTH.fullmatch(month):
            bad.append(("json", job["status"], text))
    assert not bad, bad[:10]
    assert time.monotonic() - started < 120


def test_out_of_vocabulary_ids_past_the_api_fail_the_job_as_a_400(stack: Stack, services) -> None:
    """Where the API does not know the vocabulary, the engine's refusal is the job's 400."""
    jobs = {
        submit_unchecked(services, stack, body(stack, max_tokens=4, logit_bias={"5000": 1})): "logit_bias",
        submit_unchecked(services, stack, body(stack, max_tokens=4, stop_token_ids=[5000])): "stop_token_ids",
    }
    with stack.client() as client:
        done = wait_for(client, list(jobs), timeout=60)
    for job_id, param in jobs.items():
        job = done[job_id]
        assert job["status"] == "failed" and job["attempts"] == 1, job
        assert job["error"]["type"] == "invalid_request_error" and job["error"]["param"] == param, job[
            "error"
        ]
