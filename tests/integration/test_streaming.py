"""Streaming: SSE with replay and resume, the recorded stream, and the openai SDK."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import redis

from app.schemas.completion import ChatCompletionChunk, RecordedStream
from tests.helpers import Stack, auth, events, read_all, submit_unchecked, text_of, wait_for

pytestmark = pytest.mark.integration


def submit(stack: Stack, **fields) -> str:
    body = {"model": stack.model, "messages": [{"role": "user", "content": "Stream to me."}], **fields}
    with stack.client() as c:
        r = c.post("/v2/jobs", json=body)
        assert r.status_code == 202, r.text
        return str(r.json()["id"])


def stored_text(stack: Stack, job_id: str, index: int = 0) -> str:
    with stack.client() as c:
        job = wait_for(c, [job_id])[job_id]
    return str(job["response"]["choices"][index]["message"]["content"])


def test_live_stream_matches_the_stored_result(stack: Stack) -> None:
    job_id = submit(stack, max_tokens=300, ignore_eos=True, stream_options={"include_usage": True})
    with stack.client() as c:
        evts = read_all(c, f"/v2/jobs/{job_id}/stream")
    assert evts[-1].done
    chunks = [e for e in evts if not e.done and e.json.get("choices")]
    for e in chunks:
        ChatCompletionChunk.model_validate(e.json)
    first = chunks[0].json
    assert first["choices"][0]["delta"]["role"] == "assistant"
    assert len({(e.json["id"], e.json["created"]) for e in chunks}) == 1
    assert chunks[-1].json["choices"][0]["finish_reason"] == "length"
    usage_chunk = evts[-2].json
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 300
    ids = [e.id for e in evts if e.id]
    assert ids == sorted(ids, key=lambda i: tuple(map(int, i.split("-"))))
    # Coalesced: far fewer events than tokens.
    assert len(chunks) < 150
    assert text_of(evts) == stored_text(stack, job_id)


def test_resume_with_last_event_id_gets_the_rest_exactly_once(stack: Stack) -> None:
    job_id = submit(stack, max_tokens=600, ignore_eos=True)
    with stack.client() as c:
        with c.stream("GET", f"/v2/jobs/{job_id}/stream") as r:
            it = events(r)
            head = [next(it) for _ in range(3)]
        rest = read_all(c, f"/v2/jobs/{job_id}/stream", {"Last-Event-ID": head[-1].id or ""})
    head_ids = {e.id for e in head}
    assert not head_ids & {e.id for e in rest}
    assert text_of(head) + text_of(rest) == stored_text(stack, job_id)


def test_late_subscriber_gets_everything_then_the_end(stack: Stack, stores) -> None:
    job_id = submit(stack, max_tokens=50, ignore_eos=True)
    text = stored_text(stack, job_id)
    with stack.client() as c:
        from_redis = read_all(c, f"/v2/jobs/{job_id}/stream")
        assert text_of(from_redis) == text and from_redis[-1].done
        # Once the Redis Stream is gone (expired), the same events come from Postgres.
        redis.Redis.from_url(stores.redis_url).delete(f"llmq:events:{job_id}")
        started = time.monotonic()
        from_pg = read_all(c, f"/v2/jobs/{job_id}/stream")
        assert time.monotonic() - started < 5
        assert [e.id for e in from_pg] == [e.id for e in from_redis]
        assert text_of(from_pg) == text
        middle = from_pg[1].id
        resumed = read_all(c, f"/v2/jobs/{job_id}/stream", {"Last-Event-ID": middle or ""})
        assert text_of(from_pg[:2]) + text_of(resumed) == text


def test_recorded_stream_has_seed_shape(stack: Stack) -> None:
    job_id = submit(stack, max_tokens=40, ignore_eos=True)
    text = stored_text(stack, job_id)
    with stack.client() as c:
        recorded = RecordedStream.model_validate(c.get(f"/v2/jobs/{job_id}/events").json())
    assert recorded.usage is not None and recorded.usage.completion_tokens == 40
    assert "".join(ch.delta.content or "" for e in recorded.events for ch in e.choices) == text


def test_failed_job_streams_one_error_then_done(stack: Stack, services) -> None:
    long = {"model": stack.model, "messages": [{"role": "user", "content": "word " * 3000}], "max_tokens": 3}
    job_id = submit_unchecked(services, stack, long)
    with stack.client() as c:
        evts = read_all(c, f"/v2/jobs/{job_id}/stream")
    assert [e.done for e in evts] == [False, True]
    assert evts[0].json["error"]["code"] == "context_length_exceeded"


def test_bad_last_event_id_and_other_tenant(stack: Stack, services) -> None:
    job_id = submit(stack, max_tokens=2)
    with stack.client() as c:
        r = c.get(f"/v2/jobs/{job_id}/stream", headers={"Last-Event-ID": "banana"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "Last-Event-ID"
    other = services.keys.create_key("tenant-stream-other")
    with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {other}"}) as c:
        assert c.get(f"/v2/jobs/{job_id}/stream").status_code == 404
        assert c.get(f"/v2/jobs/{job_id}/events").status_code == 404
    with httpx.Client(base_url=stack.url) as c:
        assert c.get(f"/v2/jobs/{job_id}/stream").status_code == 401


def test_many_subscribers_and_a_slow_one(stack: Stack, services) -> None:
    job_ids = [submit(stack, max_tokens=200, ignore_eos=True) for _ in range(8)]
    # 65 streams of one tenant through four of its keys: each key stays well inside the default
    # cap of 32 open streams (the cap has its own tests) however the readers' starts line up.
    keys = [stack.key] + [services.keys.create_key("tenant-e2e") for _ in range(3)]

    def slow_reader() -> tuple[str, float]:
        with stack.client() as c, c.stream("GET", f"/v2/jobs/{job_ids[0]}/stream", timeout=120) as r:
            got = []
            for e in events(r):
                got.append(e)
                # A reader that falls far behind: its time is its events times this, and a
                # job that ran quiet before its readers came logs fewer, larger events.
                time.sleep(0.5)
            return text_of(got), time.monotonic()

    def reader(i: int) -> tuple[str, float]:
        with httpx.Client(base_url=stack.url, headers=auth(keys[1 + i % 3]), timeout=60) as c:
            evts = read_all(c, f"/v2/jobs/{job_ids[i % 8]}/stream")
            return text_of(evts), time.monotonic()

    with ThreadPoolExecutor(65) as pool:
        slow = pool.submit(slow_reader)
        results = list(pool.map(reader, range(64)))
        slow_text, slow_finished = slow.result(timeout=300)
    # The 64 others were not held back by the slow one; it still got everything, in order.
    assert max(t for _, t in results) < slow_finished
    texts = [stored_text(stack, j) for j in job_ids]
    assert all(text == texts[i % 8] for i, (text, _) in enumerate(results))
    assert slow_text == texts[0]


def test_openai_sdk_create_and_stream(stack: Stack) -> None:
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=stack.key, max_retries=0)
    completion = client.chat.completions.create(
        model=stack.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=12, temperature=0
    )
    assert completion.object == "chat.completion"
    assert completion.choices[0].message.role == "assistant"
    assert completion.usage is not None and completion.usage.completion_tokens <= 12
    pieces, usage, ids = [], None, set()
    stream = client.chat.completions.create(
        model=stack.model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=30,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        ids.add(chunk.id)
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
    assert len(ids) == 1
    greedy = client.chat.completions.create(
        model=stack.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=30, temperature=0
    )
    assert "".join(pieces) == greedy.choices[0].message.content
    assert usage is not None and greedy.usage is not None
    assert usage.completion_tokens == greedy.usage.completion_tokens
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=stack.model, messages=[{"role": "user", "content": "Hi"}], n=99)
    assert exc.value.body["param"] == "n"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "Hi"}])


def test_a_job_nobody_watches_stores_every_token_of_its_merged_updates(stack: Stack) -> None:
    """While nobody hears a job's latest announcement, the worker takes vLLM's updates at
    most every 0.1 s, merged by vLLM meanwhile (worker/streaming.py). Two identical greedy
    jobs side by side, one watched from the start and one never: the same text, every token
    and every token's logprobs stored, and the unwatched one's recorded stream adds up."""
    fields = {"max_tokens": 1900, "ignore_eos": True, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    watched, alone = submit(stack, **fields), submit(stack, **fields)
    with stack.client() as c:
        live = read_all(c, f"/v2/jobs/{watched}/stream")
        jobs = wait_for(c, [watched, alone])
        replay = read_all(c, f"/v2/jobs/{alone}/stream")
    a, b = jobs[watched], jobs[alone]
    assert a["status"] == b["status"] == "succeeded"
    # Long enough for many merged updates (and past the publisher's 1 s grace).
    assert b["e2e_seconds"] - b["queue_wait_seconds"] > 2.0, b
    assert b["usage"]["completion_tokens"] == 1900
    choice_a, choice_b = a["response"]["choices"][0], b["response"]["choices"][0]
    assert len(choice_b["logprobs"]["content"]) == 1900
    assert [t["token"] for t in choice_b["logprobs"]["content"]] == [
        t["token"] for t in choice_a["logprobs"]["content"]
    ]
    assert choice_b["message"]["content"] == choice_a["message"]["content"] == text_of(live)
    assert text_of(replay) == choice_b["message"]["content"]


def test_a_job_streamed_after_its_submit_comes_token_by_token_not_at_the_quiet_interval(
    stack: Stack,
) -> None:
    """A job submitted without `stream: true` asks vLLM for an update every
    `LLMQ_QUIET_STREAM_INTERVAL` tokens (16); a client that streams it brings it back to every
    other token from the next steps on (worker/vllm_engine.py's `hasten`), so its chunks come
    at the live cadence of 8 tokens. Left at 16, its 600 tokens would come in at most 39
    chunks; every token is there either way."""
    job_id = submit(stack, max_tokens=600, ignore_eos=True, temperature=0, logprobs=True)
    with stack.client() as c:
        evts = read_all(c, f"/v2/jobs/{job_id}/stream")
        job = wait_for(c, [job_id])[job_id]
    sizes = [
        len(e.json["choices"][0]["logprobs"]["content"])
        for e in evts
        if not e.done and e.json.get("choices") and e.json["choices"][0].get("logprobs")
    ]
    assert sum(sizes) == job["usage"]["completion_tokens"] == 600
    assert len(sizes) >= 60, sizes
    assert text_of(evts) == job["response"]["choices"][0]["message"]["content"]
