"""`VllmEngine.hasten` against the shape of vLLM 0.32's output processor (the real one is
exercised by tests/integration/test_streaming.py): every child of the request gets the live
interval, a request vLLM does not have yet is remembered for its first update, and one that
already updates at least that often is left alone."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

from worker.vllm_engine import LIVE_INTERVAL, VllmEngine


def engine_with(states: dict[str, int], external: dict[str, list[str]]) -> tuple[VllmEngine, dict]:
    processor = SimpleNamespace(
        request_states={rid: SimpleNamespace(stream_interval=i) for rid, i in states.items()},
        external_req_ids=defaultdict(list, external),
    )
    engine = VllmEngine.__new__(VllmEngine)  # no vLLM import, no engine
    engine._llm = SimpleNamespace(output_processor=processor)
    engine._hasten_later = set()
    return engine, processor.request_states


def test_every_child_of_the_request_gets_the_live_interval() -> None:
    engine, states = engine_with(
        {"a-0": 16, "a-1": 16, "b": 16, "c": 1},
        {"job_a-1": ["a-0", "a-1"], "job_b-1": ["b"], "job_c-1": ["c"]},
    )
    engine.hasten("job_a-1")
    engine.hasten("job_c-1")
    assert {rid: s.stream_interval for rid, s in states.items()} == {
        "a-0": LIVE_INTERVAL,
        "a-1": LIVE_INTERVAL,
        "b": 16,  # not streamed
        "c": 1,  # every token already
    }
    assert engine._hasten_later == set()


def test_a_request_vllm_does_not_have_yet_is_lowered_later() -> None:
    engine, states = engine_with({}, {})
    engine.hasten("job_x-1")
    assert engine._hasten_later == {"job_x-1"}
    assert not engine._llm.output_processor.external_req_ids  # asking added nothing
    engine._llm.output_processor.external_req_ids["job_x-1"] = ["x"]
    states["x"] = SimpleNamespace(stream_interval=16)
    assert engine._lower_interval("job_x-1")
    assert states["x"].stream_interval == LIVE_INTERVAL


def test_an_engine_without_that_state_keeps_the_interval_and_fails_nothing() -> None:
    engine = VllmEngine.__new__(VllmEngine)
    engine._llm = object()  # another vLLM version: no output_processor
    engine._hasten_later = set()
    engine.hasten("job_y-1")
    assert engine._hasten_later == {"job_y-1"}
