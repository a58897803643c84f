from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest

from app.schemas.completion import ChatCompletion
from tests.unit.fakes import FakeStore, FakeStreams
from worker.engine import ByteRenderer, InstantEngine
from worker.loop import LoopThread
from worker.runner import JobRunner, RunnerConfig
from worker.stats import ResourceSampler, self_pid


@pytest.fixture
def loop() -> Iterator[LoopThread]:
    lt = LoopThread()
    lt.start()
    yield lt
    lt.stop()


def make_runner(loop: LoopThread, engine: InstantEngine, store: FakeStore, streams: FakeStreams) -> JobRunner:
    return JobRunner(
        store,  # type: ignore[arg-type]
        engine,
        loop,
        ByteRenderer(),
        ResourceSampler(self_pid, None),
        streams,  # type: ignore[arg-type]
        RunnerConfig(
            "w1", lease_seconds=30, max_attempts=3, job_timeout_seconds=30, system_fingerprint="fp_test"
        ),
    )


def wait_until(condition: Callable[[], object], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


def body(**fields) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hello"}], **fields}


def test_success_writes_completion_usage_and_stats(loop: LoopThread) -> None:
    store, events = FakeStore(), FakeStreams()
    store.add("job_1", body(max_tokens=5, n=2))
    runner = make_runner(loop, InstantEngine(), store, events)
    assert runner.run("job_1") == "succeeded"
    job = store.jobs["job_1"]
    completion = ChatCompletion.model_validate(job["response"])
    assert [c.index for c in completion.choices] == [0, 1]
    assert completion.choices[0].message.content == "tok0 tok1 tok2 tok3 tok4"
    assert completion.choices[0].finish_reason == "length"
    assert job["usage"]["completion_tokens"] == 10
    assert job["usage"]["prompt_tokens"] == len(b"hello")
    assert job["generation_stats"]["peak_memory_usage"]["inBytes"] > 0
    assert events.ended == [("job_1", "succeeded")]


def test_second_delivery_of_a_claimed_job_does_nothing(loop: LoopThread) -> None:
    store, events = FakeStore(), FakeStreams()
    store.add("job_1", body(max_tokens=2))
    runner = make_runner(loop, InstantEngine(), store, events)
    assert runner.run("job_1") == "succeeded"
    assert runner.run("job_1") is None
    assert store.jobs["job_1"]["epoch"] == 1


def test_prompt_over_context_fails_this_job_only(loop: LoopThread) -> None:
    store, events = FakeStore(), FakeStreams()
    store.add("job_long", body(messages=[{"role": "user", "content": "x" * 100}]))
    store.add("job_ok", body(max_tokens=1))
    runner = make_runner(loop, InstantEngine(context=50), store, events)
    assert runner.run("job_long") == "failed"
    assert store.jobs["job_long"]["error"]["error"]["code"] == "context_length_exceeded"
    assert runner.run("job_ok") == "succeeded"


def test_cancel_keeps_partial_text(loop: LoopThread) -> None:
    store, events = FakeStore(), FakeStreams()
    store.add("job_1", body(max_tokens=1000))
    runner = make_runner(loop, InstantEngine(delay=0.005), store, events)
    result: list[str | None] = []
    t = threading.Thread(target=lambda: result.append(runner.run("job_1")))
    t.start()
    # Cancel once some text has been streamed, so there is partial text to keep.
    wait_until(lambda: "tok1" in str(list(events.shipped.get("job_1", []))))
    assert runner.cancel("job_1")
    t.join(5)
    assert result == ["cancelled"]
    choice = store.jobs["job_1"]["response"]["choices"][0]
    assert choice["message"]["content"].startswith("tok0 tok1")
    # Not "stop": the model did not end its answer (vLLM says "abort", outside the API's set).
    assert choice["finish_reason"] == "error"
    chunks = [e["data"] for e in events.shipped["job_1"] if e["type"] == "chunk"]
    last = [c for chunk in chunks for c in chunk["choices"] if c["finish_reason"]]
    assert [c["finish_reason"] for c in last] == ["error"]
    assert 0 < store.jobs["job_1"]["usage"]["completion_tokens"] < 1000


def test_write_refused_by_fence_reports_nothing(loop: LoopThread) -> None:
    store, events = FakeStore(), FakeStreams()
    store.add("job_1", body(max_tokens=200))
    runner = make_runner(loop, InstantEngine(delay=0.002), store, events)
    result: list[str | None] = []
    t = threading.Thread(target=lambda: result.append(runner.run("job_1")))
    t.start()
    deadline = time.monotonic() + 5
    while not runner.inflight() and time.monotonic() < deadline:
        time.sleep(0.005)
    store.jobs["job_1"]["epoch"] += 1  # another worker took over
    t.join(5)
    assert result == [None]
    assert store.jobs["job_1"]["status"] == "running"
    assert events.ended == []


def test_release_all_hands_unfinished_jobs_back(loop: LoopThread) -> None:
    store, events = FakeStore(), FakeStreams()
    store.add("job_1", body(max_tokens=4000))
    runner = make_runner(loop, InstantEngine(delay=0.01), store, events)
    t = threading.Thread(target=runner.run, args=("job_1",))
    t.start()
    deadline = time.monotonic() + 5
    while not runner.inflight() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert runner.release_all(grace_seconds=0.05) == 1
    t.join(5)
    assert store.jobs["job_1"]["status"] == "queued"


def test_stream_chunks_join_to_the_stored_text(loop: LoopThread) -> None:
    store, streams = FakeStore(), FakeStreams()
    store.add("job_1", body(max_tokens=10, n=2))
    runner = make_runner(loop, InstantEngine(), store, streams)
    assert runner.run("job_1") == "succeeded"
    events = streams.shipped["job_1"]
    chunks = [e["data"] for e in events if e["type"] == "chunk"]
    assert [e["id"] for e in events] == [f"1-{i}" for i in range(1, len(events) + 1)]
    assert events[-1]["type"] == "end" and events[-1]["usage"]["completion_tokens"] == 20
    for index in (0, 1):
        parts = [c for chunk in chunks for c in chunk["choices"] if c["index"] == index]
        assert parts[0]["delta"]["role"] == "assistant"
        assert sum(1 for p in parts if "role" in p["delta"]) == 1
        assert parts[-1]["finish_reason"] == "length"
        text = "".join(p["delta"].get("content", "") for p in parts)
        assert text == store.jobs["job_1"]["response"]["choices"][index]["message"]["content"]
    assert len({(c["id"], c["created"]) for c in chunks}) == 1
    assert store.jobs["job_1"]["events"] == events


def test_failed_job_ends_its_stream_with_the_error(loop: LoopThread) -> None:
    store, streams = FakeStore(), FakeStreams()
    store.add("job_long", body(messages=[{"role": "user", "content": "x" * 100}]))
    runner = make_runner(loop, InstantEngine(context=50), store, streams)
    assert runner.run("job_long") == "failed"
    (end,) = streams.shipped["job_long"]
    assert end["type"] == "end" and end["error"]["code"] == "context_length_exceeded"


def test_a_chunk_runs_together_and_one_bad_line_fails_alone(loop: LoopThread) -> None:
    store, streams = FakeStore(), FakeStreams()
    for i in range(6):
        content = "x" * 100 if i == 3 else f"line {i}"
        store.add(f"job_{i}", body(messages=[{"role": "user", "content": content}], max_tokens=3))
    runner = make_runner(loop, InstantEngine(context=50), store, streams)
    statuses = runner.run_many([f"job_{i}" for i in range(6)] + ["job_missing"])
    assert statuses == {f"job_{i}": ("failed" if i == 3 else "succeeded") for i in range(6)}
    assert store.jobs["job_3"]["error"]["error"]["code"] == "context_length_exceeded"
    assert all(store.jobs[f"job_{i}"]["usage"]["completion_tokens"] == 3 for i in range(6) if i != 3)
    assert sorted(j for j, _ in streams.ended) == [f"job_{i}" for i in range(6)]
