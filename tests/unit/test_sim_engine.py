"""The simulated GPU engine (worker/sim_engine.py): its time model on a fake clock, admission
order beyond `max_num_seqs`, deterministic text, stops, and abort."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pytest

from app.settings import Settings
from worker.engine import EngineUpdate, GenerationSpec, PromptTooLong, RequestRejected
from worker.runtime import build_engine
from worker.sim_engine import Clock, SimulatedEngine, StepCost

T = TypeVar("T")

# 10 ms a step, 1 ms per running sequence, 0.5 ms per prompt token admitted.
COST = StepCost(step_ms=10.0, step_ms_per_seq=1.0, prefill_ms_per_token=0.5)


class FakeClock(Clock):
    """Jumps instead of waiting; first the loop turns a few times, so whoever was handed
    tokens sees them at the time they were made."""

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        for _ in range(5):
            await asyncio.sleep(0)
        self.t += seconds


@dataclass
class Seen:
    """One request's updates and the fake time each arrived at."""

    times: list[float] = field(default_factory=list)
    updates: list[EngineUpdate] = field(default_factory=list)

    def text(self, index: int = 0) -> str:
        return "".join(d.text for u in self.updates for d in u.deltas if d.index == index)

    def finish(self, index: int = 0) -> str | None:
        reasons = [d.finish_reason for u in self.updates for d in u.deltas if d.index == index]
        return reasons[-1]

    def tokens(self, index: int = 0) -> int:
        return sum(len(d.token_ids) for u in self.updates for d in u.deltas if d.index == index)


def spec(request_id: str, prompt: int = 10, priority: int = 0, **sampling: Any) -> GenerationSpec:
    return GenerationSpec(
        request_id, list(range(1, prompt + 1)), {"max_tokens": 5, **sampling}, priority=priority
    )


async def consume(engine: SimulatedEngine, clock: FakeClock, s: GenerationSpec) -> Seen:
    seen = Seen()
    async for update in engine.generate(s):
        seen.times.append(round(clock.now(), 6))
        seen.updates.append(update)
    return seen


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def engine_and_clock(max_num_seqs: int = 4, **kw: Any) -> tuple[SimulatedEngine, FakeClock]:
    clock = FakeClock()
    return SimulatedEngine(max_num_seqs=max_num_seqs, cost=COST, clock=clock, **kw), clock


def test_a_step_costs_a_fixed_part_plus_one_per_running_sequence_plus_prefill() -> None:
    async def go() -> Seen:
        engine, clock = engine_and_clock()
        return await consume(engine, clock, spec("a", prompt=10, max_tokens=4))

    seen = run(go())
    # Prefill step: 10 + 1×1 + 0.5×10 = 16 ms, then 11 ms a step for one sequence.
    assert seen.times == [0.016, 0.027, 0.038, 0.049]
    assert seen.tokens() == 4 and seen.finish() == "length"


def test_running_sequences_slow_every_step_and_share_the_prefill_step() -> None:
    async def go() -> list[Seen]:
        engine, clock = engine_and_clock()
        return list(
            await asyncio.gather(
                consume(engine, clock, spec("a", prompt=10, max_tokens=2)),
                consume(engine, clock, spec("b", prompt=20, max_tokens=3, n=2)),
            )
        )

    a, b = run(go())
    # Step 1: 10 + 3 sequences + 0.5×30 = 28 ms; step 2: 13 ms; a is done, so step 3: 12 ms.
    assert a.times == [0.028, 0.041]
    assert b.times == [0.028, 0.041, 0.053]
    assert [b.tokens(0), b.tokens(1)] == [3, 3]


def test_beyond_max_num_seqs_requests_wait_and_are_admitted_in_arrival_order() -> None:
    async def go() -> list[Seen]:
        engine, clock = engine_and_clock(max_num_seqs=2)
        # They arrive in this order, before the first step.
        specs = [spec(f"r{i}", max_tokens=3) for i in range(5)]
        return list(await asyncio.gather(*(consume(engine, clock, s) for s in specs)))

    seen = run(go())
    first = [s.times[0] for s in seen]
    # r0 and r1 run steps 1-3; r2 and r3 are admitted when they end, r4 after those.
    assert first[0] == first[1] < first[2] == first[3] < first[4]
    assert seen[2].times[0] > seen[0].times[-1]
    assert seen[4].times[0] > seen[2].times[-1]


def test_a_lower_priority_value_is_admitted_first_and_no_request_skips_the_head() -> None:
    async def go() -> dict[str, Seen]:
        engine, clock = engine_and_clock(max_num_seqs=2)
        order = [
            spec("running", max_tokens=3, n=2),  # fills the engine
            spec("late-urgent", max_tokens=3, priority=-5),
            spec("wide", max_tokens=1, n=2),
            spec("narrow", max_tokens=1),
        ]
        tasks = {}
        for s in order:
            tasks[s.request_id] = asyncio.ensure_future(consume(engine, clock, s))
            await asyncio.sleep(0)
        # "urgent" arrives last but outranks everything waiting.
        urgent = spec("urgent", max_tokens=1, priority=-9)
        tasks["urgent"] = asyncio.ensure_future(consume(engine, clock, urgent))
        done = await asyncio.gather(*tasks.values())
        return dict(zip(tasks, done, strict=True))

    seen = run(go())
    start = {name: s.times[0] for name, s in seen.items()}
    # When "urgent" ends, one sequence is free: "narrow" would fit, but "wide" is ahead.
    assert start["urgent"] == start["late-urgent"] < start["wide"] < start["narrow"]
    assert start["wide"] > seen["late-urgent"].times[-1]


def test_text_is_a_function_of_the_prompt_and_the_seed() -> None:
    async def texts(**sampling: Any) -> list[str]:
        engine, clock = engine_and_clock()
        seen = await consume(engine, clock, spec("x", prompt=12, max_tokens=8, **sampling))
        return [seen.text(i) for i in range(spec("x", **sampling).n)]

    again = run(texts(seed=3))
    assert again == run(texts(seed=3))
    assert again != run(texts(seed=4))
    assert len(again[0].split()) == 8
    two = run(texts(seed=3, n=2))
    assert two[0] == again[0] and two[1] != two[0]

    async def other_prompt() -> str:
        engine, clock = engine_and_clock()
        return (await consume(engine, clock, spec("y", prompt=13, max_tokens=8, seed=3))).text()

    assert run(other_prompt()) != again[0]


def test_a_stop_string_cuts_the_text_and_is_never_streamed() -> None:
    async def go(**sampling: Any) -> Seen:
        engine, clock = engine_and_clock()
        return await consume(engine, clock, spec("s", prompt=7, max_tokens=12, seed=1, **sampling))

    full = run(go()).text()
    words = full.split()
    stop = f"{words[4][:2]}"
    at = full.find(stop)
    assert at > 0
    cut = run(go(stop=[stop, "never-there"]))
    assert cut.text() == full[:at]
    assert cut.finish() == "stop"
    assert cut.updates[-1].deltas[0].stop_reason == stop and cut.updates[-1].finished
    assert run(go(stop=[stop], include_stop_str_in_output=True)).text() == full[: at + len(stop)]


def test_a_stop_token_id_ends_the_choice() -> None:
    async def go(**sampling: Any) -> Seen:
        engine, clock = engine_and_clock()
        return await consume(engine, clock, spec("s", prompt=7, max_tokens=12, seed=2, **sampling))

    ids = [t for u in run(go()).updates for d in u.deltas for t in d.token_ids]
    stopped = run(go(stop_token_ids=[ids[3]]))
    assert stopped.tokens() == ids.index(ids[3]) + 1
    assert stopped.finish() == "stop"


def test_abort_ends_a_running_request_at_once_and_frees_its_sequences() -> None:
    async def go() -> tuple[Seen, Seen, float]:
        engine, clock = engine_and_clock(max_num_seqs=1)
        long = asyncio.ensure_future(consume(engine, clock, spec("long", max_tokens=1000)))
        await asyncio.sleep(0)
        waiting = asyncio.ensure_future(consume(engine, clock, spec("next", max_tokens=2)))
        while not long.done() and clock.now() < 0.1:
            await asyncio.sleep(0)
        aborted_at = clock.now()
        await engine.abort("long")
        return await long, await waiting, aborted_at

    long, waiting, aborted_at = run(go())
    assert long.finish() == "abort" and long.updates[-1].finished
    assert 0 < long.tokens() < 1000
    assert waiting.finish() == "length" and aborted_at < waiting.times[0] < aborted_at + 0.05


def test_abort_of_a_waiting_request_means_it_never_runs() -> None:
    async def go() -> tuple[Seen, Seen, int]:
        engine, clock = engine_and_clock(max_num_seqs=1)
        first = asyncio.ensure_future(consume(engine, clock, spec("first", max_tokens=3)))
        await asyncio.sleep(0)
        queued = asyncio.ensure_future(consume(engine, clock, spec("queued", max_tokens=3)))
        await asyncio.sleep(0)
        await engine.abort("queued")
        done = await first, await queued
        return done[0], done[1], engine.steps

    first, queued, steps = run(go())
    assert queued.tokens() == 0 and queued.finish() == "abort"
    assert first.tokens() == 3 and steps == 3


def test_a_consumer_that_goes_away_frees_its_sequences() -> None:
    async def go() -> Seen:
        engine, clock = engine_and_clock(max_num_seqs=1)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(consume(engine, clock, spec("gone", max_tokens=10_000)), 0.01)
        assert engine.running_seqs == 0
        return await consume(engine, clock, spec("after", max_tokens=2))

    assert run(go()).finish() == "length"


def test_requests_it_cannot_run_are_refused() -> None:
    async def first(s: GenerationSpec) -> None:
        engine, clock = engine_and_clock(max_num_seqs=2, context=64)
        await consume(engine, clock, s)

    with pytest.raises(PromptTooLong):
        run(first(spec("long", prompt=64)))
    with pytest.raises(RequestRejected) as structured:
        run(first(spec("json", structured_outputs={"json": {"type": "object"}})))
    assert structured.value.param == "response_format"
    with pytest.raises(RequestRejected):
        run(first(spec("wide", n=3)))


def test_on_the_real_clock_it_sleeps_through_its_steps() -> None:
    settings = Settings(
        engine="simulated",
        served_model_name="made-up-7b",
        max_num_seqs=8,
        sim_step_ms=20.0,
        sim_step_ms_per_seq=0.0,
        sim_prefill_ms_per_token=0.0,
    )
    engine, _ = build_engine(settings)
    assert isinstance(engine, SimulatedEngine)

    async def go() -> list[int]:
        await engine.start()
        specs = [spec(f"r{i}", max_tokens=10) for i in range(8)]

        async def count(s: GenerationSpec) -> int:
            return sum(len(d.token_ids) for u in [u async for u in engine.generate(s)] for d in u.deltas)

        tokens = await asyncio.gather(*(count(s) for s in specs))
        await engine.close()
        return list(tokens)

    wall, cpu = time.perf_counter(), time.process_time()
    assert run(go()) == [10] * 8
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    # Ten steps of 20 ms, all eight sequences together, and the CPU idle meanwhile.
    assert 0.2 <= wall < 1.5
    assert cpu < wall / 2


def test_logprobs_come_with_each_token_when_asked_for() -> None:
    async def go(**sampling: Any) -> Seen:
        engine, clock = engine_and_clock()
        return await consume(engine, clock, spec("lp", max_tokens=3, seed=1, **sampling))

    plain = run(go())
    assert all(d.logprobs is None for u in plain.updates for d in u.deltas)
    asked = run(go(logprobs=2))
    entries = [lp for u in asked.updates for d in u.deltas for lp in d.logprobs or []]
    assert "".join(lp.token for lp in entries) == asked.text() == plain.text()
    assert all(len(lp.top) == 2 and lp.logprob <= 0 for lp in entries)
