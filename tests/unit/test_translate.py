from __future__ import annotations

import pytest

from app.errors import InvalidRequest
from app.schemas.chat import ChatCompletionV2Request
from worker.translate import translate


class FixedRenderer:
    def __init__(self, length: int) -> None:
        self.length = length

    def render(self, req: ChatCompletionV2Request, plan=None) -> list[int]:
        return list(range(self.length))


def run(fields: dict, *, prompt: int = 10, context: int = 100, kind: str = "chat"):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return translate(
        body, request_id="r", kind=kind, renderer=FixedRenderer(prompt), max_model_len=context
    ).spec


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"temperature": 0.0}, {"temperature": 0.0}),
        ({"top_p": 0.5}, {"top_p": 0.5}),
        ({"top_k": 7}, {"top_k": 7}),
        ({"top_k": -1}, {"top_k": 0}),
        ({"min_p": 0.2}, {"min_p": 0.2}),
        ({"seed": 42}, {"seed": 42}),
        ({"stop": "END"}, {"stop": ["END"]}),
        ({"stop": ["a", "b"]}, {"stop": ["a", "b"]}),
        ({"n": 3}, {"n": 3}),
        ({"ignore_eos": True}, {"ignore_eos": True}),
        ({"max_tokens": 12}, {"max_tokens": 12}),
        ({"max_completion_tokens": 9, "max_tokens": 50}, {"max_tokens": 9}),
        ({"presence_penalty": 0.5}, {"presence_penalty": 0.5}),
        ({"frequency_penalty": -1.0}, {"frequency_penalty": -1.0}),
        ({"repetition_penalty": 1.3}, {"repetition_penalty": 1.3}),
        ({"logit_bias": {"5": 10, "7": -100}}, {"logit_bias": {5: 10.0, 7: -100.0}}),
        ({"stop_token_ids": [3]}, {"stop_token_ids": [3]}),
        ({"include_stop_str_in_output": True}, {"include_stop_str_in_output": True}),
        ({"min_tokens": 4}, {"min_tokens": 4}),
        ({"skip_special_tokens": False}, {"skip_special_tokens": False}),
        ({"spaces_between_special_tokens": False}, {"spaces_between_special_tokens": False}),
        ({"logprobs": True}, {"logprobs": 0}),
        ({"logprobs": True, "top_logprobs": 5}, {"logprobs": 5}),
        ({"guided_json": {"type": "object"}}, {"structured_outputs": {"json": {"type": "object"}}}),
        ({"guided_regex": "[a-z]+"}, {"structured_outputs": {"regex": "[a-z]+"}}),
        ({"guided_choice": ["x", "y"]}, {"structured_outputs": {"choice": ["x", "y"]}}),
        ({"guided_grammar": "root ::= 'a'"}, {"structured_outputs": {"grammar": "root ::= 'a'"}}),
        ({"response_format": {"type": "json_object"}}, {"structured_outputs": {"json_object": True}}),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "s", "schema": {"type": "array"}},
                }
            },
            {"structured_outputs": {"json": {"type": "array"}}},
        ),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
                "tool_choice": {"type": "function", "function": {"name": "f"}},
            },
            {"structured_outputs": {"json": {"type": "object"}}},
        ),
    ],
)
def test_field_reaches_sampling_params(fields, expected) -> None:
    spec = run(fields)
    for key, value in expected.items():
        assert spec.sampling[key] == value


def test_default_max_tokens_fills_the_context() -> None:
    assert run({}, prompt=30, context=100).sampling["max_tokens"] == 70


def test_priority_is_passed_to_the_engine() -> None:
    assert run({"priority": -3}).priority == -3


def test_bench_jobs_ignore_eos_and_generate_exactly_max_tokens() -> None:
    spec = run({"max_tokens": 20}, kind="bench")
    assert spec.sampling["ignore_eos"] is True
    assert spec.sampling["min_tokens"] == 20


def test_prompt_over_context_is_a_400_for_this_job() -> None:
    with pytest.raises(InvalidRequest) as exc:
        run({}, prompt=100, context=100)
    assert exc.value.code == "context_length_exceeded"
    assert exc.value.param == "messages"


def test_max_tokens_over_remaining_context() -> None:
    with pytest.raises(InvalidRequest) as exc:
        run({"max_tokens": 91}, prompt=10, context=100)
    assert exc.value.param == "max_tokens"


def test_required_tools_constrain_to_an_array_of_calls() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    spec = run({"tools": tools, "tool_choice": "required", "parallel_tool_calls": False})
    schema = spec.sampling["structured_outputs"]["json"]
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    assert schema["items"]["anyOf"][0]["properties"]["name"] == {"type": "string", "enum": ["f"]}


def test_free_text_has_no_constraint_and_no_logprobs() -> None:
    spec = run({})
    assert "structured_outputs" not in spec.sampling and "logprobs" not in spec.sampling


def test_echo_prefix_only_for_a_final_assistant_message() -> None:
    from worker.translate import echo_prefix

    body = {
        "model": "m",
        "echo": True,
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello, I am"}],
    }
    assert echo_prefix(ChatCompletionV2Request.model_validate(body)) == "Hello, I am"
    body["messages"] = body["messages"][:1]
    assert echo_prefix(ChatCompletionV2Request.model_validate(body)) == ""


def test_a_request_not_streamed_asks_the_engine_for_updates_at_the_quiet_interval() -> None:
    def sampling(fields: dict, interval: int) -> dict:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
        spec = translate(
            body,
            request_id="r",
            kind="chat",
            renderer=FixedRenderer(10),
            max_model_len=100,
            quiet_interval=interval,
        ).spec
        return spec.sampling

    assert sampling({}, 16)["stream_interval"] == 16
    assert sampling({"stream": False}, 16)["stream_interval"] == 16
    assert "stream_interval" not in sampling({"stream": True}, 16)  # read as it comes
    assert "stream_interval" not in sampling({}, 1)  # vLLM's default: every token
    text = translate(
        {"model": "m", "prompt": [1, 2, 3]},
        request_id="r",
        kind="completion",
        renderer=FixedRenderer(10),
        max_model_len=100,
        quiet_interval=8,
    )
    assert text.spec.sampling["stream_interval"] == 8
