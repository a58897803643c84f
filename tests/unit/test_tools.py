from __future__ import annotations

import json
from typing import Any

from app.domain.tools import call_id, parse_constrained, plan_tools
from app.schemas.chat import ChatCompletionV2Request
from worker.engine import ChoiceDelta
from worker.response import ChoiceState, finalize

TOOLS = [
    {
        "type": "function",
        "function": {"name": "a", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}},
    },
    {"type": "function", "function": {"name": "b"}},
]


def req(**fields: Any) -> ChatCompletionV2Request:
    return ChatCompletionV2Request.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    )


def state(text: str, reason: str = "stop") -> ChoiceState:
    s = ChoiceState(0)
    s.add(ChoiceDelta(0, text, [1], finish_reason=reason))
    return s


def test_named_tool_answers_with_one_call() -> None:
    plan = plan_tools(
        req(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "a"}}), auto_parser=None
    )
    assert plan.mode == "named" and plan.schema() == TOOLS[0]["function"]["parameters"]
    final = finalize(
        state('{"x": 3}'), job_id="job_1", plan=plan, echo="", logprobs=False, request={}, extract=None
    )
    assert final.finish_reason == "tool_calls" and final.message["content"] is None
    assert final.message["tool_calls"] == [
        {"id": call_id("job_1", 0, 0), "type": "function", "function": {"name": "a", "arguments": '{"x": 3}'}}
    ]


def test_cut_arguments_stay_text_with_length() -> None:
    plan = plan_tools(
        req(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "a"}}), auto_parser=None
    )
    final = finalize(
        state('{"x": 3', "length"), job_id="j", plan=plan, echo="", logprobs=False, request={}, extract=None
    )
    assert (
        final.finish_reason == "length"
        and final.message["content"] == '{"x": 3'
        and not final.message["tool_calls"]
    )


def test_required_parses_every_call() -> None:
    plan = plan_tools(req(tools=TOOLS, tool_choice="required"), auto_parser=None)
    text = json.dumps([{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}])
    calls = parse_constrained(plan, text, "j", 0)
    assert calls is not None and [c["function"]["name"] for c in calls] == ["a", "b"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"x": 1}
    assert len({c["id"] for c in calls}) == 2


def test_legacy_functions_answer_with_function_call() -> None:
    r = req(functions=[TOOLS[0]["function"]], function_call={"name": "a"})
    plan = plan_tools(r, auto_parser=None)
    final = finalize(
        state('{"x": 1}'), job_id="j", plan=plan, echo="", logprobs=False, request={}, extract=None
    )
    assert final.finish_reason == "function_call"
    assert final.message["function_call"] == {"name": "a", "arguments": '{"x": 1}'}
    assert final.message["tool_calls"] is None


def test_auto_uses_the_engine_parser() -> None:
    plan = plan_tools(req(tools=TOOLS), auto_parser="hermes")
    found = ("", [{"id": "call_9", "type": "function", "function": {"name": "b", "arguments": "{}"}}])
    final = finalize(
        state("<tool_call>..."),
        job_id="j",
        plan=plan,
        echo="",
        logprobs=False,
        request={},
        extract=lambda text, request: found,
    )
    assert final.finish_reason == "tool_calls" and final.message["tool_calls"][0]["id"] == "call_9"
    plain = finalize(
        state("just text"),
        job_id="j",
        plan=plan,
        echo="",
        logprobs=False,
        request={},
        extract=lambda text, request: None,
    )
    assert plain.finish_reason == "stop" and plain.message["content"] == "just text"


def test_echo_prefixes_text() -> None:
    plan = plan_tools(req(), auto_parser=None)
    final = finalize(
        state(" world"), job_id="j", plan=plan, echo="Hello", logprobs=False, request={}, extract=None
    )
    assert final.message["content"] == "Hello world"
