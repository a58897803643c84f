from __future__ import annotations

from ipaddress import ip_address

import pytest

from app.errors import InvalidRequest, NotFound, Unsupported
from app.schemas.chat import ChatCompletionV2Request
from app.services.contract import HONOURED, RequestPolicy, unsafe_url_reason
from app.settings import Settings
from tests.unit.fakes import served

SETTINGS = Settings(max_n=4, max_tokens_limit=100, max_messages=3)
POLICY = RequestPolicy(SETTINGS, served("m"))

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "get_time"}},
]


def req(**fields) -> ChatCompletionV2Request:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return ChatCompletionV2Request.model_validate(body)


# A value that asks for something, for every field this deployment does not honour.
NOT_HONOURED = {
    "modalities": ["text", "audio"],
    "reasoning_effort": "low",
    "audio": {"voice": "alloy", "format": "wav"},
    "prediction": {"type": "content", "content": "x"},
    "web_search_options": {},
    "use_beam_search": True,
    "length_penalty": 0.5,
    "early_stopping": True,
    "guided_whitespace_pattern": " ",
}

# A value that is honoured, for every other field.
HONOURED_EXAMPLES = {
    "messages": [{"role": "user", "content": "hi"}],
    "model": "m",
    "max_tokens": 10,
    "max_completion_tokens": 10,
    "temperature": 0.5,
    "top_p": 0.9,
    "top_k": 5,
    "min_p": 0.1,
    "seed": 3,
    "stop": ["a", "b"],
    "n": 2,
    "ignore_eos": True,
    "priority": -1,
    "presence_penalty": 0.5,
    "frequency_penalty": -0.5,
    "repetition_penalty": 1.2,
    "logit_bias": {"5": 10, "7": -100},
    "stop_token_ids": [3, 4],
    "include_stop_str_in_output": True,
    "min_tokens": 2,
    "skip_special_tokens": False,
    "spaces_between_special_tokens": False,
    "logprobs": True,
    "top_logprobs": 0,
    "echo": True,
    "add_generation_prompt": False,
    "continue_final_message": True,
    "add_special_tokens": True,
    "documents": [{"title": "t", "text": "x"}],
    "chat_template": "{{ messages[0].content }}",  # honoured where the setting allows it
    "chat_template_kwargs": {"enable_thinking": False},
    "guided_json": {"type": "object"},
    "guided_regex": "a+",
    "guided_choice": ["a", "b"],
    "guided_grammar": "root ::= 'a'",
    "guided_decoding_backend": "guidance",
    "response_format": {"type": "json_object"},
    "tools": TOOLS,
    "tool_choice": "required",
    "parallel_tool_calls": False,
    "functions": [{"name": "f"}],
    "function_call": {"name": "f"},
    "best_of": 1,
    "stream": True,
    "stream_options": {"include_usage": True},
    "metadata": {"k": "v"},
    "user": "u",
    "service_tier": "flex",
    "store": True,
}

NEEDS = {  # fields only meaningful beside another
    "top_logprobs": {"logprobs": True},
    "tool_choice": {"tools": TOOLS},
    "parallel_tool_calls": {"tools": TOOLS, "tool_choice": "required"},
    "function_call": {"functions": [{"name": "f"}]},
    "functions": {"function_call": "none"},
    "tools": {"tool_choice": "required"},
    "continue_final_message": {"add_generation_prompt": False},
}


def test_every_request_field_is_honoured_or_refused() -> None:
    fields = set(ChatCompletionV2Request.model_fields)
    assert fields == set(NOT_HONOURED) | set(HONOURED_EXAMPLES)
    assert set(HONOURED_EXAMPLES) <= HONOURED | {"chat_template"}
    assert not set(NOT_HONOURED) & HONOURED


@pytest.mark.parametrize("name", sorted(NOT_HONOURED))
def test_each_field_not_honoured_is_refused_by_name(name: str) -> None:
    with pytest.raises(Unsupported) as exc:
        POLICY.check(req(**{name: NOT_HONOURED[name]}))
    assert exc.value.param == name
    assert exc.value.status == 400
    assert name in exc.value.message


@pytest.mark.parametrize("name", sorted(HONOURED_EXAMPLES))
def test_each_honoured_field_passes(name: str) -> None:
    fields = {**NEEDS.get(name, {}), name: HONOURED_EXAMPLES[name]}
    # Every example asks for something (a None would be skipped, checking nothing).
    assert HONOURED_EXAMPLES[name] is not None
    policy = POLICY
    if name == "chat_template":
        allowing = SETTINGS.model_copy(update={"allow_custom_chat_template": True})
        policy = RequestPolicy(allowing, served("m"))
        with pytest.raises(Unsupported):
            POLICY.check(req(**fields), streaming=True)
    policy.check(req(**fields), streaming=True)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"best_of": 3}, "best_of"),
        ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
        ({"chat_template": "{{ messages }}"}, "chat_template"),
        ({"tools": TOOLS}, "tool_choice"),  # auto is the default with tools, and needs a parser
        ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),
        ({"functions": [{"name": "f"}]}, "function_call"),
    ],
)
def test_conditional_refusals(fields, param) -> None:
    with pytest.raises(Unsupported) as exc:
        POLICY.check(req(**fields))
    assert exc.value.param == param


def test_custom_template_allowed_by_setting() -> None:
    allowing = RequestPolicy(Settings(allow_custom_chat_template=True), served("m"))
    allowing.check(req(chat_template="{{ messages }}"))
    with pytest.raises(InvalidRequest):
        allowing.check(req(chat_template="x" * 70_000))


def test_auto_tools_with_a_parser() -> None:
    RequestPolicy(Settings(tool_call_parser="hermes"), served("m")).check(req(tools=TOOLS))


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
        ({"guided_choice": ["a"], "response_format": {"type": "json_object"}}, "response_format"),
        ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
        ),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "functions": [{"name": "f"}]}, "functions"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        ({"guided_choice": []}, "guided_choice"),
    ],
)
def test_contradictions_are_400(fields, param) -> None:
    with pytest.raises(InvalidRequest) as exc:
        POLICY.check(req(**fields))
    assert exc.value.param == param


def test_stream_only_where_the_endpoint_streams() -> None:
    POLICY.check(req(stream=True, stream_options={"include_usage": True}), streaming=True)
    with pytest.raises(InvalidRequest) as exc:
        POLICY.check(req(stream=True))
    assert exc.value.param == "stream"


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1/x.png",
        "http://localhost:8080/x.png",
        "http://10.0.0.5/x.png",
        "http://192.168.1.1/x.png",
        "http://169.254.169.254/latest/meta-data",
        "http://[::1]/x.png",
        "file:///etc/passwd",
        "gopher://example.com/",
        "http://0.0.0.0/",
        # Non-canonical forms a fetcher reads as loopback or metadata (inet_aton, IPv4-in-IPv6).
        "http://0x7f000001/x.png",
        "http://2130706433/x.png",
        "http://127.1/x.png",
        "http://0177.0.0.1/x.png",
        "http://0x7f.1/x.png",
        "http://[::ffff:127.0.0.1]/x.png",
        "http://[::ffff:a9fe:a9fe]/latest/meta-data",
        # A name that does not resolve cannot be checked, so it is not allowed either.
        "http://no-such-host.invalid/x.png",
    ],
)
def test_image_urls_to_private_places_are_refused_before_anything(url: str) -> None:
    assert unsafe_url_reason(url)
    body = [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": url}}]
    with pytest.raises(InvalidRequest) as exc:
        POLICY.check(req(messages=[{"role": "user", "content": body}]))
    assert exc.value.param == "messages[0].content[1].image_url.url"
    assert "refused" in exc.value.message and "not allowed" in exc.value.message


def test_public_image_is_refused_as_text_only() -> None:
    # A public literal: the check needs no DNS (names are covered in test_addresses.py).
    assert (
        unsafe_url_reason("https://example.com/cat.png", lambda host: [ip_address("93.184.216.34")]) is None
    )
    body = [{"type": "image_url", "image_url": {"url": "https://93.184.216.34/cat.png"}}]
    with pytest.raises(Unsupported) as exc:
        POLICY.check(req(messages=[{"role": "user", "content": body}]))
    assert exc.value.param == "messages[0].content[0].type"


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


def test_prompt_length_is_counted_before_queuing() -> None:
    counting = RequestPolicy(SETTINGS, served("m", count=lambda r: 90, max_model_len=100))
    counting.check(req(max_tokens=10))
    with pytest.raises(InvalidRequest) as exc:
        counting.check(req(max_tokens=11))
    assert exc.value.code == "context_length_exceeded" and exc.value.param == "max_tokens"
    too_long = RequestPolicy(SETTINGS, served("m", count=lambda r: 100, max_model_len=100))
    with pytest.raises(InvalidRequest) as exc:
        too_long.check(req())
    assert exc.value.param == "messages"


def test_unknown_model() -> None:
    with pytest.raises(NotFound) as exc:
        POLICY.check(req(model="other"))
    assert exc.value.param == "model"
    assert exc.value.code == "model_not_found"


@pytest.mark.parametrize(
    "key",
    [
        "chat_template",
        "tokenize",
        "tokenizer",
        "return_dict",
        "return_tensors",
        "padding",
        "truncation",
        "max_length",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "messages",
        "eos_token",
        "raise_exception",
        "range",
        "_private",
        "has space",
    ],
)
def test_template_kwargs_that_change_the_template_or_its_call_are_refused(key: str) -> None:
    """`chat_template_kwargs` reach `apply_chat_template(**kwargs)`: only plain template
    variables may pass, or the template refusal is bypassed (issue 9 item 2)."""
    for policy in (POLICY, RequestPolicy(Settings(allow_custom_chat_template=True), served("m"))):
        with pytest.raises(InvalidRequest) as exc:
            policy.check(req(chat_template_kwargs={key: "{% for i in range(3000) %}{% endfor %}"}))
        assert exc.value.status == 400
        assert exc.value.param == f"chat_template_kwargs.{key}"


def test_a_template_in_kwargs_is_refused_like_chat_template() -> None:
    with pytest.raises(Unsupported) as direct:
        POLICY.check(req(chat_template="{{ messages }}"))
    with pytest.raises(Unsupported) as smuggled:
        POLICY.check(req(chat_template_kwargs={"chat_template": "{{ messages }}"}))
    assert smuggled.value.message == direct.value.message.replace(
        "`chat_template`", "`chat_template_kwargs.chat_template`"
    )


def test_plain_template_variables_pass_within_a_size_bound() -> None:
    POLICY.check(req(chat_template_kwargs={"enable_thinking": False, "persona": {"name": "x", "tags": [1]}}))
    with pytest.raises(InvalidRequest) as exc:
        POLICY.check(req(chat_template_kwargs={"notes": "x" * 20_000}))
    assert exc.value.param == "chat_template_kwargs"
