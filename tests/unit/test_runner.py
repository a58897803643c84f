from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from app.schemas.completion import ChatCompletion
from tests.unit.fakes import FakeStore, FakeStreams, fake_runner
from worker.engine import ByteRenderer, InstantEngine
from worker.loop import LoopThread
from worker.runner import JobRunner


@pytest.fixture
def loop() -> Iterator[LoopThread]:
    lt = LoopThread()
    lt.start()
    yield lt
    lt.stop()


def make_runner(loop: LoopThread, engine: InstantEngine, store: FakeStore, streams: FakeStreams) -> JobRunner:
    return fake_runner(store, loop, engine=engine, streams=streams, fingerprint="fp_test")


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


def test_a_thread_waiting_for_a_slot_claims_nothing_once_the_worker_drains(loop: LoopThread) -> None:
    """The drain's aborts free slots; a task thread that was waiting for one must not claim
    new work with it (it would run past the grace): its jobs go back unclaimed."""
    store, streams = FakeStore(), FakeStreams()
    store.add("job_long", body(max_tokens=4000))
    for i in range(3):
        store.add(f"job_next_{i}", body(max_tokens=2))
    runner = fake_runner(store, loop, engine=InstantEngine(delay=0.01), streams=streams, max_inflight=1)
    running = threading.Thread(target=runner.run, args=("job_long",))
    running.start()
    wait_until(runner.inflight)
    waiting = threading.Thread(target=runner.run_many, args=([f"job_next_{i}" for i in range(3)],))
    waiting.start()
    time.sleep(0.1)  # it waits for the one slot
    assert runner.release_all(grace_seconds=0.05) == 1
    running.join(5)
    waiting.join(5)
    assert not running.is_alive() and not waiting.is_alive()
    assert {j: job["status"] for j, job in store.jobs.items()} == dict.fromkeys(store.jobs, "queued")
    assert sorted(store.handed_back) == [f"job_next_{i}" for i in range(3)]
    assert all(store.jobs[f"job_next_{i}"]["attempts"] == 0 for i in range(3))


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


class AbortsRecorded(InstantEngine):
    def __init__(self, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(**kwargs)
        self.aborts: list[str] = []

    async def abort(self, request_id: str) -> None:
        self.aborts.append(request_id)
        await super().abort(request_id)


def test_a_job_past_its_deadline_fails_alone_and_is_aborted_in_the_engine(loop: LoopThread) -> None:
    store, streams = FakeStore(), FakeStreams()
    store.add("job_slow", body(max_tokens=1000))
    store.add("job_quick", body(max_tokens=2))
    engine = AbortsRecorded(delay=0.01)  # 10 s for the slow one
    runner = fake_runner(store, loop, engine=engine, streams=streams, job_timeout_seconds=0.3)
    started = time.monotonic()
    assert runner.run_many(["job_slow", "job_quick"]) == {"job_slow": "failed", "job_quick": "succeeded"}
    assert 0.3 <= time.monotonic() - started < 3
    error = store.jobs["job_slow"]["error"]["error"]
    assert (error["code"], error["type"]) == ("timeout", "timeout")
    assert error["message"].startswith("the job ran past its deadline")
    assert engine.aborts == ["job_slow-1"]
    assert sorted(j for j, _ in streams.ended) == ["job_quick", "job_slow"]


class WritesRecorded(FakeStore):
    """Records each result write: the job ids it held."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[set[str]] = []

    def finish_many(self, results):  # type: ignore[no-untyped-def]
        self.writes.append({r.job_id for r in results})
        return super().finish_many(results)


def test_a_chunks_short_lines_are_stored_while_its_long_ones_still_run(
    loop: LoopThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One hand-over to the loop a chunk; each line is written as it ends, and a short
    line's result is stored (its slot back) while the chunk's long lines still generate."""
    store, streams = WritesRecorded(), FakeStreams()
    short, long = [f"job_s{i}" for i in range(4)], [f"job_l{i}" for i in range(2)]
    for job_id in short:
        store.add(job_id, body(max_tokens=1))
    for job_id in long:
        store.add(job_id, body(max_tokens=60))
    runner = fake_runner(
        store, loop, engine=InstantEngine(delay=0.01), streams=streams, fingerprint="fp_test", max_inflight=8
    )
    submitted: list[object] = []
    submit = loop.submit
    monkeypatch.setattr(loop, "submit", lambda coro: submitted.append(coro) or submit(coro))
    statuses: dict[str, str | None] = {}
    chunk = threading.Thread(target=lambda: statuses.update(runner.run_many(short + long, batch=True)))
    chunk.start()
    wait_until(lambda: all(store.jobs[j]["status"] == "succeeded" for j in short))
    assert all(store.jobs[j]["status"] == "running" for j in long)
    chunk.join(10)
    assert statuses == dict.fromkeys(short + long, "succeeded")
    assert len(submitted) == 1
    # Every short line was written before any long one, none of them twice.
    first_long = next(i for i, written in enumerate(store.writes) if written & set(long))
    assert set().union(*store.writes[:first_long]) == set(short)
    assert set().union(*store.writes[first_long:]) == set(long)
    assert sum(map(len, store.writes)) == len(short + long)


class CountingEngine(InstantEngine):
    """Counts the requests inside the engine at once (all on the loop thread)."""

    def __init__(self, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(**kwargs)
        self.now = 0
        self.peak = 0

    async def generate(self, spec):  # type: ignore[no-untyped-def]
        self.now += 1
        self.peak = max(self.peak, self.now)
        try:
            async for update in super().generate(spec):
                yield update
        finally:
            self.now -= 1


class SlowWrites(WritesRecorded):
    """Also records the job ids of each claim. The first claim waits until `go` is set; each
    write takes 0.1 s, as one waiting on Postgres would."""

    def __init__(self) -> None:
        super().__init__()
        self.claims: list[list[str]] = []
        self.go = threading.Event()

    def claim_many(self, job_ids, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.claims.append(list(job_ids))
        assert self.go.wait(10)
        return super().claim_many(job_ids, *args, **kwargs)

    def finish_many(self, results):  # type: ignore[no-untyped-def]
        time.sleep(0.1)
        return super().finish_many(results)


def test_jobs_run_at_once_are_claimed_and_stored_together_each_once(loop: LoopThread) -> None:
    """16 task threads at once: their claims and result writes go as a few statements, not
    16 each; a second delivery of a job made at the same moment is never in its claim's
    statement, and one of the two runs it."""
    store = SlowWrites()
    ids = [f"job_{i}" for i in range(16)]
    for job_id in ids:
        store.add(job_id, body(max_tokens=2))
    runner = make_runner(loop, InstantEngine(), store, FakeStreams())
    with ThreadPoolExecutor(20) as pool:
        running = pool.map(runner.run, ids + ids[:4])
        # The first claim holds the statement until the other 19 wait behind it.
        wait_until(lambda: len(runner._claims._waiting) == 19)
        store.go.set()
        statuses = list(running)
    assert statuses[4:16] == ["succeeded"] * 12
    for first, again in zip(statuses[:4], statuses[16:], strict=True):
        assert sorted([first, again], key=str) == [None, "succeeded"]
    assert all(store.jobs[j]["status"] == "succeeded" and store.jobs[j]["epoch"] == 1 for j in ids)
    assert len(store.claims) <= 3 and len(store.writes) <= 6, (store.claims, store.writes)
    assert all(len(set(claim)) == len(claim) for claim in store.claims)
    assert sorted(j for write in store.writes for j in write) == sorted(ids)


def test_jobs_in_the_engine_never_exceed_the_workers_capacity(loop: LoopThread) -> None:
    """Six task threads each run a chunk of 8 batch lines against a capacity of 10: never more
    than 10 jobs in the engine; the lines that did not fit go back to the feeder unclaimed,
    none is lost and nothing deadlocks."""
    store, streams = FakeStore(), FakeStreams()
    chunks = [[f"job_{c}_{i}" for i in range(8)] for c in range(6)]
    for job_id in (j for chunk in chunks for j in chunk):
        store.add(job_id, body(max_tokens=20))
    engine = CountingEngine(delay=0.005)
    runner = fake_runner(store, loop, engine=engine, streams=streams, fingerprint="fp_test", max_inflight=10)
    threads = [threading.Thread(target=runner.run_many, args=(chunk,)) for chunk in chunks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not any(t.is_alive() for t in threads)
    assert 1 <= engine.peak <= 10
    succeeded = {j for j, job in store.jobs.items() if job["status"] == "succeeded"}
    assert len(succeeded) >= 10
    assert succeeded | set(store.handed_back) == set(store.jobs)
    assert all(store.jobs[j]["status"] == "queued" for j in store.handed_back)
    # Single jobs wait for a slot instead of being handed back.
    store.add("job_single", body(max_tokens=2))
    assert runner.run("job_single") == "succeeded"


def test_a_batch_chunk_that_finds_the_worker_full_goes_back_whole_after_a_short_wait(
    loop: LoopThread,
) -> None:
    """A chunk waiting for slots in a full worker is out of every other worker's reach: after
    `chunk_slot_wait_seconds` it goes back to the feeder, unclaimed, instead of waiting on."""
    store, streams = FakeStore(), FakeStreams()
    busy = [f"busy_{i}" for i in range(4)]
    late = [f"late_{i}" for i in range(3)]
    for job_id in busy + late:
        store.add(job_id, body(max_tokens=100))
    runner = fake_runner(
        store,
        loop,
        engine=InstantEngine(delay=0.02),  # two seconds a job
        streams=streams,
        fingerprint="fp_test",
        max_inflight=4,
        chunk_slot_wait_seconds=0.2,
    )
    first = threading.Thread(target=runner.run_many, args=(busy,), kwargs={"batch": True})
    first.start()
    while len(runner.inflight()) < 4:
        time.sleep(0.01)
    started = time.monotonic()
    assert runner.run_many(late, batch=True) == {}
    assert 0.2 <= time.monotonic() - started < 1.5
    assert store.handed_back == late
    assert all(store.jobs[j]["status"] == "queued" and store.jobs[j]["attempts"] == 0 for j in late)
    first.join(20)
    assert all(store.jobs[j]["status"] == "succeeded" for j in busy)


class GatedRenderer(ByteRenderer):
    """Renders once `gate` opens, recording what it was asked to render."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.rendering = threading.Event()
        self.seen: list[str] = []

    def render(self, req, plan=None) -> list[int]:  # type: ignore[no-untyped-def]
        self.rendering.set()
        self.seen.append(req.messages[0].content[:10])
        assert self.gate.wait(5)
        return super().render(req, plan)


def runner_with(loop: LoopThread, store: FakeStore, renderer: ByteRenderer, **config) -> JobRunner:  # type: ignore[no-untyped-def]
    return fake_runner(store, loop, renderer=renderer, **config)


def test_a_request_over_the_bound_fails_alone_before_it_is_rendered(loop: LoopThread) -> None:
    store, renderer = FakeStore(), GatedRenderer()
    renderer.gate.set()
    store.add("job_big", body(messages=[{"role": "user", "content": "big " * 1000}]))
    store.add("job_ok", body(max_tokens=2))
    runner = runner_with(loop, store, renderer, max_request_bytes=2048)
    assert runner.run_many(["job_big", "job_ok"]) == {"job_big": "failed", "job_ok": "succeeded"}
    error = store.jobs["job_big"]["error"]["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "request_too_large"
    assert store.jobs["job_big"]["attempts"] == 1
    assert renderer.seen == ["hello"]  # the big one was never rendered


def test_a_job_is_in_flight_while_its_prompt_renders(loop: LoopThread) -> None:
    """In flight means the lease keeper renews its lease: a slow render is not taken over
    and rendered twice at once (issue 9 item 5)."""
    store, renderer = FakeStore(), GatedRenderer()
    store.add("job_1", body(max_tokens=2))
    runner = runner_with(loop, store, renderer)
    result: list[str | None] = []
    t = threading.Thread(target=lambda: result.append(runner.run("job_1")))
    t.start()
    assert renderer.rendering.wait(5)
    assert [i.job_id for i in runner.inflight()] == ["job_1"]
    renderer.gate.set()
    t.join(5)
    assert result == ["succeeded"] and runner.inflight() == []


def test_a_cancel_while_rendering_is_not_lost(loop: LoopThread) -> None:
    store, renderer = FakeStore(), GatedRenderer()
    store.add("job_1", body(max_tokens=50))
    runner = runner_with(loop, store, renderer)
    result: list[str | None] = []
    t = threading.Thread(target=lambda: result.append(runner.run("job_1")))
    t.start()
    assert renderer.rendering.wait(5)
    assert runner.cancel("job_1")
    renderer.gate.set()
    t.join(5)
    assert result == ["cancelled"]
    assert store.jobs["job_1"]["usage"]["completion_tokens"] == 0


# --- poison recognition (issue 9 item 1) -------------------------------------------------

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}}


def constrained(spec) -> bool:
    return "structured_outputs" in spec.sampling


def test_engine_death_fails_an_untried_constraint_alone_and_hands_the_rest_back(loop: LoopThread) -> None:
    from tests.unit.fakes import DyingEngine
    from worker.engine import EngineDead

    store, streams = FakeStore(), FakeStreams()
    store.add("job_poison", body(max_tokens=50, guided_json=SCHEMA))
    store.add("job_other", body(max_tokens=50))
    engine = DyingEngine(kills=constrained)
    runner = make_runner(loop, engine, store, streams)  # type: ignore[arg-type]
    with pytest.raises(EngineDead):
        runner.run_many(["job_other", "job_poison"])
    poison = store.jobs["job_poison"]
    assert poison["status"] == "failed" and poison["attempts"] == 1
    assert poison["error"]["error"]["type"] == "invalid_request_error"
    assert poison["error"]["error"]["param"] == "guided_json"
    assert "not retried" in poison["error"]["error"]["message"]
    assert ("job_poison", "failed") in streams.ended
    # The other tenant's job goes back to the queue, to run again on a fresh engine.
    assert store.jobs["job_other"]["status"] == "queued"
    assert store.jobs["job_other"]["attempts"] == 1


def test_a_constraint_that_already_ran_in_this_engine_is_not_a_suspect(loop: LoopThread) -> None:
    from tests.unit.fakes import DyingEngine
    from worker.engine import EngineDead

    store, streams = FakeStore(), FakeStreams()
    store.add("job_first", body(max_tokens=3, guided_json=SCHEMA))
    store.add("job_again", body(max_tokens=50, guided_json=SCHEMA))
    store.add("job_killer", body(max_tokens=50, messages=[{"role": "user", "content": "kill"}]))
    engine = DyingEngine(delay=0.01)
    runner = make_runner(loop, engine, store, streams)  # type: ignore[arg-type]
    assert runner.run("job_first") == "succeeded"
    engine.kills = lambda spec: not constrained(spec)
    with pytest.raises(EngineDead):
        runner.run_many(["job_killer", "job_again"])
    # The schema produced tokens in this engine before: the job is handed back, not failed.
    assert store.jobs["job_again"]["status"] == "queued"
    assert store.jobs["job_killer"]["status"] == "queued"


def test_engine_refusing_a_parameter_fails_the_job_as_a_400(loop: LoopThread) -> None:
    from worker.engine import RequestRejected

    class Refusing(InstantEngine):
        async def generate(self, spec):  # type: ignore[override]
            raise RequestRejected(
                "token_id(s) [99999] in logit_bias contain out-of-vocab token ids", "logit_bias"
            )
            yield  # pragma: no cover

    store, streams = FakeStore(), FakeStreams()
    store.add("job_1", body(logit_bias={"99999": 5}))
    runner = make_runner(loop, Refusing(), store, streams)
    assert runner.run("job_1") == "failed"
    error = store.jobs["job_1"]["error"]["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "logit_bias"


def test_worker_compiles_constraints_in_the_sandbox_and_fails_a_bomb_alone(loop: LoopThread) -> None:
    from app.services.sandbox import ConstraintSandbox
    from tests.bombs import chained_grammar

    store, streams = FakeStore(), FakeStreams()
    store.add("job_bomb", body(max_tokens=2, guided_grammar=chained_grammar()))
    store.add("job_ok", body(max_tokens=2, guided_regex="[0-9]+"))
    sandbox = ConstraintSandbox("guidance", processes=1)
    runner = fake_runner(store, loop, streams=streams, constraints=sandbox)
    try:
        statuses = runner.run_many(["job_bomb", "job_ok"])
    finally:
        sandbox.close()
    assert statuses == {"job_bomb": "failed", "job_ok": "succeeded"}
    error = store.jobs["job_bomb"]["error"]["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "guided_grammar"
    assert store.jobs["job_bomb"]["attempts"] == 1


def test_a_job_handed_back_with_its_attempts_spent_ends_failed_not_stuck(loop: LoopThread) -> None:
    """On its last attempt a job the engine died under cannot go back to the queue: no claim
    would take it again, and it would sit `queued` for ever."""
    from tests.unit.fakes import DyingEngine
    from worker.engine import EngineDead

    store, streams = FakeStore(), FakeStreams()
    store.add("job_last", body(max_tokens=50))
    store.add("job_fresh", body(max_tokens=50))
    store.jobs["job_last"]["attempts"] = 2  # this claim is its third and last
    runner = make_runner(loop, DyingEngine(kills=lambda spec: True), store, streams)
    with pytest.raises(EngineDead):
        runner.run_many(["job_last", "job_fresh"])
    last = store.jobs["job_last"]
    assert last["status"] == "failed" and last["attempts"] == 3
    assert last["error"]["error"]["code"] == "attempts_exhausted"
    assert ("job_last", "failed") in streams.ended
    assert store.jobs["job_fresh"]["status"] == "queued"  # still has attempts: handed back


def test_every_log_line_about_a_job_carries_its_request_id(
    loop: LoopThread, caplog: pytest.LogCaptureFixture
) -> None:
    """The id stored on the job (read by the claim) is in the `extra` of every line the
    runner writes for it, whichever jobs run beside it."""
    store, events = FakeStore(), FakeStreams()
    store.add("job_a", body(max_tokens=2), request_id="req-a")
    store.add("job_b", body(messages=[{"role": "user", "content": "x" * 100}]), request_id="req-b")
    store.add("job_c", body(max_tokens=2))  # made before request ids
    runner = make_runner(loop, InstantEngine(context=50), store, events)  # job_b's prompt is too long
    with caplog.at_level(logging.DEBUG, logger="llmq.runner"):
        runner.run("job_a")
        runner.run("job_b")
        runner.run_many(["job_c"])
    about = {
        job: [r for r in caplog.records if getattr(r, "job_id", None) == job]
        for job in ("job_a", "job_b", "job_c")
    }
    assert {r.getMessage() for r in about["job_a"]} >= {"job claimed", "job succeeded"}
    assert {r.getMessage() for r in about["job_b"]} >= {"job claimed", "job failed"}
    assert all(getattr(r, "request_id", None) == "req-a" for r in about["job_a"])
    assert all(getattr(r, "request_id", None) == "req-b" for r in about["job_b"])
    assert about["job_c"] and all(not hasattr(r, "request_id") for r in about["job_c"])


class MergingEngine(InstantEngine):
    """Generates on its own clock, as vLLM does: the updates its consumer has not taken yet
    merge into one (text and token ids appended). Counts the updates taken."""

    merges_updates = True

    def __init__(self, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(**kwargs)
        self.taken = 0

    async def generate(self, spec):  # type: ignore[no-untyped-def]
        import asyncio

        from worker.engine import ChoiceDelta, EngineUpdate

        pending: list[EngineUpdate] = []
        ready = asyncio.Event()

        async def produce() -> None:
            async for update in InstantEngine.generate(self, spec):
                pending.append(update)
                ready.set()

        producer = asyncio.ensure_future(produce())
        try:
            while True:
                await ready.wait()
                ready.clear()
                batch = pending[:]
                pending.clear()
                deltas = [
                    ChoiceDelta(
                        i,
                        "".join(d.text for u in batch for d in u.deltas if d.index == i),
                        [t for u in batch for d in u.deltas if d.index == i for t in d.token_ids],
                        finish_reason=batch[-1].deltas[i].finish_reason,
                    )
                    for i in range(spec.n)
                ]
                self.taken += 1
                yield EngineUpdate(deltas, batch[-1].prompt_tokens, 0, batch[-1].finished)
                if batch[-1].finished:
                    return
        finally:
            producer.cancel()


class QuietStreams(FakeStreams):
    """Nobody hears any job: its updates may wait `pause` seconds (StreamPublisher's quiet
    cadence, from its first event on)."""

    def __init__(self, pause: float) -> None:
        super().__init__()
        self.pause = pause

    def merge_seconds(self, job_id: str) -> float:
        return self.pause


def test_a_job_nobody_watches_takes_the_engines_steps_merged_and_loses_none(loop: LoopThread) -> None:
    store, streams = FakeStore(), QuietStreams(0.03)
    store.add("job_1", body(max_tokens=150, n=2))
    engine = MergingEngine(delay=0.002)
    runner = make_runner(loop, engine, store, streams)
    assert runner.run("job_1") == "succeeded"
    completion = ChatCompletion.model_validate(store.jobs["job_1"]["response"])
    expected = " ".join(f"tok{i}" for i in range(150))
    assert [c.message.content for c in completion.choices] == [expected, expected]
    assert [c.finish_reason for c in completion.choices] == ["length", "length"]
    assert store.jobs["job_1"]["usage"]["completion_tokens"] == 300
    # 150 steps of 2 ms, taken at most every 30 ms: a few dozen updates, not 150.
    assert engine.taken < 75
    # The streamed chunks carry the same text.
    chunks = [e for e in streams.shipped["job_1"] if e.get("type") == "chunk"]
    streamed = "".join(
        c["data"]["choices"][0]["delta"].get("content") or ""
        for c in chunks
        if c["data"]["choices"] and c["data"]["choices"][0]["index"] == 0
    )
    assert streamed == expected


def test_a_watched_job_takes_every_step(loop: LoopThread) -> None:
    store, streams = FakeStore(), QuietStreams(0.0)
    store.add("job_1", body(max_tokens=60))
    engine = MergingEngine(delay=0.003)
    runner = make_runner(loop, engine, store, streams)
    assert runner.run("job_1") == "succeeded"
    assert store.jobs["job_1"]["usage"]["completion_tokens"] == 60
    assert engine.taken >= 50  # one per step, but for a step or two the loop was late for


def test_an_engine_that_does_not_merge_is_never_made_to_wait(loop: LoopThread) -> None:
    """InstantEngine's next token waits for its consumer: pausing would slow the job itself
    (100 tokens at a 0.05 s pause would take 5 s)."""
    store, streams = FakeStore(), QuietStreams(0.05)
    store.add("job_1", body(max_tokens=100))
    runner = make_runner(loop, InstantEngine(delay=0.001), store, streams)
    started = time.monotonic()
    assert runner.run("job_1") == "succeeded"
    assert time.monotonic() - started < 2.5


def test_a_merge_pause_ends_before_the_job_would_reach_its_limit() -> None:
    from worker.engine import ChoiceDelta, EngineUpdate
    from worker.runner import Outcome

    outcome = Outcome(1)
    assert outcome.merge_pause(0.1, 256) == 0.1  # nothing generated yet: no pace to go by
    outcome.add(EngineUpdate([ChoiceDelta(0, "a", list(range(101)))], 5, 0, False))
    assert outcome.first_token is not None
    outcome.first_token = outcome.last_token - 1.0  # type: ignore[operator] # 100 tokens a second
    assert outcome.merge_pause(0.1, 256) == 0.1  # 155 tokens, 1.55 s to go
    assert outcome.merge_pause(0.1, 106) == pytest.approx(0.04)  # 5 tokens: 80 % of 0.05 s
    assert outcome.merge_pause(0.1, 101) == 0.0  # at its limit: take the last update at once
    assert outcome.merge_pause(0.1, None) == 0.1  # no limit known


class IntervalsRecorded(InstantEngine):
    """Records each request's `stream_interval` and each `hasten`, with the thread it ran on."""

    def __init__(self, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(**kwargs)
        self.intervals: dict[str, int | None] = {}
        self.hastened: list[tuple[str, str]] = []

    async def generate(self, spec):  # type: ignore[no-untyped-def]
        self.intervals[spec.request_id] = spec.sampling.get("stream_interval")
        async for update in InstantEngine.generate(self, spec):
            yield update

    def hasten(self, request_id: str) -> None:
        self.hastened.append((request_id, threading.current_thread().name))


def test_a_job_not_submitted_as_a_stream_runs_at_the_quiet_interval_until_somebody_streams_it(
    loop: LoopThread,
) -> None:
    store, streams = FakeStore(), FakeStreams()
    store.add("job_quiet", body(max_tokens=200))
    store.add("job_streamed", body(max_tokens=3, stream=True))
    engine = IntervalsRecorded(delay=0.005)
    runner = fake_runner(store, loop, engine=engine, streams=streams, quiet_stream_interval=16)
    done = threading.Thread(target=runner.run, args=("job_quiet",))
    done.start()
    wait_until(lambda: "job_quiet-1" in engine.intervals)
    runner.hasten("job_quiet")  # the stream publisher's thread, in the worker
    runner.hasten("job_elsewhere")  # not running here: nothing to do
    wait_until(lambda: engine.hastened)
    done.join(10)
    assert store.jobs["job_quiet"]["status"] == "succeeded"
    assert store.jobs["job_quiet"]["usage"]["completion_tokens"] == 200
    assert engine.hastened == [("job_quiet-1", "llmq-engine-loop")]
    assert runner.run("job_streamed") == "succeeded"
    assert engine.intervals == {"job_quiet-1": 16, "job_streamed-1": None}
    # Off (1): every token, as vLLM gives by default.
    store.add("job_plain", body(max_tokens=3))
    assert fake_runner(store, loop, engine=engine, streams=streams).run("job_plain") == "succeeded"
    assert engine.intervals["job_plain-1"] is None


def test_a_job_streamed_while_its_updates_merge_is_woken_at_once(loop: LoopThread) -> None:
    """The runner of a job nobody watches leaves the engine's updates merging for a while;
    a client who comes to stream it (`hasten`) ends that wait at once, so the first live
    event is a step away rather than the rest of the merge."""
    store, streams = FakeStore(), QuietStreams(3.0)
    store.add("job_1", body(max_tokens=40))
    engine = MergingEngine(delay=0.002)
    runner = make_runner(loop, engine, store, streams)
    done = threading.Thread(target=runner.run, args=("job_1",))
    started = time.monotonic()
    done.start()
    wait_until(lambda: engine.taken >= 1)  # the first token, then a 3 s merge
    time.sleep(0.1)
    runner.hasten("job_1")
    done.join(10)
    assert time.monotonic() - started < 1.5  # not the 3 s merge
    assert store.jobs["job_1"]["usage"]["completion_tokens"] == 40
