from __future__ import annotations

import pytest

from app.errors import InvalidRequest, NotFound, Unsupported
from app.schemas.chat import ChatCompletionV2Request
from app.services.contract import HONOURED, RequestPolicy
from app.settings import Settings

SETTINGS = Settings(max_n=4, max_tokens_limit=100, max_messages=3)
POLICY = RequestPolicy(SETTINGS, frozenset({"m"}))


def req(**fields) -> ChatCompletionV2Request:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return ChatCompletionV2Request.model_validate(body)


# One value per request field that asks for something beyond the neutral default.
NON_NEUTRAL = {
    "modalities": ["text", "audio"],
    "reasoning_effort": "low",
    "frequency_penalty": 0.5,
    "presence_penalty": 0.5,
    "web_search_options": {},
    "top_logprobs": 3,
    "logprobs": True,
    "response_format": {"type": "json_object"},
    "audio": {"voice": "alloy", "format": "wav"},
    "logit_bias": {"5": 10},
    "prediction": {"type": "content", "content": "x"},
    "tools": [{"type": "function", "function": {"name": "f"}}],
    "tool_choice": "auto",
    "parallel_tool_calls": True,
    "function_call": "auto",
    "functions": [{"name": "f"}],
    "best_of": 2,
    "use_beam_search": True,
    "length_penalty": 0.5,
    "repetition_penalty": 1.3,
    "early_stopping": True,
    "stop_token_ids": [3],
    "include_stop_str_in_output": True,
    "min_tokens": 2,
    "skip_special_tokens": False,
    "spaces_between_special_tokens": False,
    "echo": True,
    "add_generation_prompt": False,
    "continue_final_message": True,
    "add_special_tokens": True,
    "documents": [{"title": "t", "text": "x"}],
    "chat_template": "{{ messages }}",
    "chat_template_kwargs": {"a": 1},
    "guided_json": {"type": "object"},
    "guided_regex": "a+",
    "guided_choice": ["a", "b"],
    "guided_grammar": "root ::= 'a'",
    "guided_decoding_backend": "outlines",
    "guided_whitespace_pattern": " ",
}


def test_every_request_field_is_classified() -> None:
    fields = set(ChatCompletionV2Request.model_fields)
    assert fields == HONOURED | set(NON_NEUTRAL)


@pytest.mark.parametrize("name", sorted(NON_NEUTRAL))
def test_each_field_not_honoured_is_refused_by_name(name: str) -> None:
    with pytest.raises(Unsupported) as exc:
        POLICY.check(req(**{name: NON_NEUTRAL[name]}))
    assert exc.value.param == name
    assert exc.value.status == 400


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "seed": 3},
        {"stop": ["a", "b"], "n": 2, "ignore_eos": True, "priority": -1},
        {"max_tokens": 10},
        {"max_completion_tokens": 10},
        {"metadata": {"k": "v"}, "user": "u", "service_tier": "default", "store": True},
        {"stream": False, "logprobs": False, "echo": False, "tool_choice": "none"},
        {"response_format": {"type": "text"}, "modalities": ["text"], "best_of": 1},
        {"skip_special_tokens": True, "add_generation_prompt": True, "min_tokens": 0},
    ],
)
def test_honoured_and_neutral_fields_pass(fields) -> None:
    POLICY.check(req(**fields))


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"logprobs": True}, "logprobs"),
        ({"guided_json": {"type": "object"}}, "guided_json"),
        ({"guided_regex": "a+"}, "guided_regex"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ({"web_search_options": {}}, "web_search_options"),
        ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
        ({"best_of": 3}, "best_of"),
        ({"chat_template": "{{ x }}"}, "chat_template"),
    ],
)
def test_unhonoured_fields_are_refused_by_name(fields, param) -> None:
    with pytest.raises(Unsupported) as exc:
        POLICY.check(req(**fields))
    assert exc.value.param == param
    assert exc.value.status == 400
    assert param in exc.value.message


def test_image_part_refused_on_text_model() -> None:
    body = [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "https://x/y.png"}}]
    with pytest.raises(Unsupported) as exc:
        POLICY.check(req(messages=[{"role": "user", "content": body}]))
    assert exc.value.param == "messages[0].content[1].type"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"n": 5}, "n"),
        ({"max_tokens": 101}, "max_tokens"),
        ({"max_completion_tokens": 101}, "max_completion_tokens"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"messages": [{"role": "user", "content": "x"}] * 4}, "messages"),
    ],
)
def test_bounds(fields, param) -> None:
    with pytest.raises(InvalidRequest) as exc:
        POLICY.check(req(**fields))
    assert exc.value.param == param


def test_stream_only_where_the_endpoint_streams() -> None:
    POLICY.check(req(stream=True, stream_options={"include_usage": True}), streaming=True)
    with pytest.raises(InvalidRequest) as exc:
        POLICY.check(req(stream=True))
    assert exc.value.param == "stream"


def test_unknown_model() -> None:
    with pytest.raises(NotFound) as exc:
        POLICY.check(req(model="other"))
    assert exc.value.param == "model"
    assert exc.value.code == "model_not_found"
