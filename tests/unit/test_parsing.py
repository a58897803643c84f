from __future__ import annotations

import pytest

from app.errors import InvalidRequest, PayloadTooLarge
from app.schemas.chat import ChatCompletionV2Request
from app.services.parsing import check_depth, error_param, load_json, parse_model


def valid() -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    ("loc", "expected"),
    [
        (("messages", 0, "user", "content"), "messages[0].content"),
        (("messages", 0, "user", "content", "str"), "messages[0].content"),
        (
            ("messages", 1, "user", "content", "list[tagged-union[TextPart,ImagePart]]", 0, "text", "text"),
            "messages[1].content[0].text",
        ),
        (("response_format", "json_schema", "json_schema", "name"), "response_format.json_schema.name"),
        (("tools", 0, "function", "name"), "tools[0].function.name"),
        (("temperature",), "temperature"),
        ((), None),
    ],
)
def test_error_param_drops_union_members_and_tags(loc, expected) -> None:
    assert error_param(loc) == expected


def test_unknown_field_is_named() -> None:
    with pytest.raises(InvalidRequest) as exc:
        parse_model(ChatCompletionV2Request, {**valid(), "frobnicate": 1})
    assert exc.value.param == "frobnicate"
    assert "Unrecognized request argument supplied: frobnicate" in exc.value.message


def test_wrong_type_is_named() -> None:
    with pytest.raises(InvalidRequest) as exc:
        parse_model(ChatCompletionV2Request, {**valid(), "temperature": "hot"})
    assert exc.value.param == "temperature"


def test_nested_wrong_type_is_named() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": 5}]}
    with pytest.raises(InvalidRequest) as exc:
        parse_model(ChatCompletionV2Request, body)
    assert exc.value.param == "messages[0].content"


def test_unknown_role_is_named() -> None:
    body = {"model": "m", "messages": [{"role": "robot", "content": "x"}]}
    with pytest.raises(InvalidRequest) as exc:
        parse_model(ChatCompletionV2Request, body)
    assert exc.value.param == "messages[0]"


def test_missing_required_field() -> None:
    with pytest.raises(InvalidRequest) as exc:
        parse_model(ChatCompletionV2Request, {"model": "m"})
    assert exc.value.param == "messages"
    assert exc.value.message.startswith("Missing required parameter")


def test_body_must_be_an_object() -> None:
    with pytest.raises(InvalidRequest):
        parse_model(ChatCompletionV2Request, [1, 2])


def test_malformed_json_reports_position() -> None:
    with pytest.raises(InvalidRequest) as exc:
        load_json(b'{"model": ', max_bytes=1000, max_depth=10)
    assert exc.value.code == "invalid_json"
    assert "line 1" in exc.value.message


def test_bad_utf8() -> None:
    with pytest.raises(InvalidRequest):
        load_json(b'{"a": "\xff"}', max_bytes=1000, max_depth=10)


def test_size_limit() -> None:
    with pytest.raises(PayloadTooLarge):
        load_json(b"x" * 2000, max_bytes=1000, max_depth=10)


def test_depth_limit_without_recursion() -> None:
    deep = b"[" * 10_000 + b"]" * 10_000
    with pytest.raises(InvalidRequest) as exc:
        check_depth(deep, 64)
    assert exc.value.code == "too_deep"


def test_brackets_inside_strings_do_not_count() -> None:
    check_depth(b'{"a": "[[[[[[[[[[[[\\"[[[["}', 3)


@pytest.mark.parametrize(
    ("raw", "param", "code"),
    [
        (b'{"a": [1, {"b": "x\\ud800"}]}', "a[1].b", "invalid_string"),
        (b'{"a": {"\\udfff": 1}}', "a.\\udfff", "invalid_string"),
        (b'{"a": -' + b"1" * 4301 + b"}", "a", "invalid_number"),
        (b'{"a": 1e400}', "a", "invalid_number"),
        (b'{"a": [Infinity]}', "a[0]", "invalid_number"),
    ],
)
def test_values_nothing_downstream_can_carry_are_named(raw: bytes, param: str, code: str) -> None:
    with pytest.raises(InvalidRequest) as exc:
        load_json(raw, max_bytes=1 << 20, max_depth=8)
    assert (exc.value.param, exc.value.code) == (param, code)


def test_surrogate_pairs_and_long_but_bounded_numbers_pass() -> None:
    data = load_json(b'{"e": "\\ud83d\\ude00", "n": ' + b"9" * 4300 + b"}", max_bytes=1 << 20, max_depth=8)
    assert data["e"] == "\U0001f600" and len(str(data["n"])) == 4300
