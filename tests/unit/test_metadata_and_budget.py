"""The pure rules of issue 13 items 5 and 6: metadata limits and list filters, and a batch
line's figure against the token budget."""

from __future__ import annotations

import pytest

from app.domain.budget import estimate_prompt_tokens, line_tokens
from app.domain.metadata import check_metadata, metadata_filter
from app.errors import InvalidRequest
from app.schemas.chat import ChatCompletionV2Request


def test_filters_are_the_bracketed_pairs_and_other_params_are_left_alone() -> None:
    args = [("status", "queued"), ("metadata[team]", "red"), ("metadata[a[b]]", ""), ("limit", "5")]
    assert metadata_filter(args) == {"team": "red", "a[b]": ""}
    assert metadata_filter([]) == {}


@pytest.mark.parametrize(
    ("args", "param"),
    [
        ([("metadata", "x")], "metadata"),
        ([("metadata[]", "x")], "metadata[]"),
        ([("metadata[k]", "a"), ("metadata[k]", "a")], "metadata[k]"),
        ([("metadata[k]", "\x00")], "metadata[k]"),
        ([(f"metadata[k{i}]", "v") for i in range(17)], "metadata"),
    ],
)
def test_bad_filters_name_their_param(args: list[tuple[str, str]], param: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        metadata_filter(args)
    assert caught.value.param == param and caught.value.status == 400


def test_metadata_limits_are_openais() -> None:
    check_metadata({f"{i:02d}" + "k" * 62: "v" * 512 for i in range(16)})
    check_metadata(None)
    for bad, param in [
        ({f"k{i}": "v" for i in range(17)}, "metadata"),
        ({"k" * 65: "v"}, "metadata." + "k" * 64),
        ({"k": "v" * 513}, "metadata.k"),
        ({"k": 3}, "metadata.k"),
        ({"": "v"}, "metadata."),
        ({"k\x00": "v"}, "metadata.k\x00"),
    ]:
        with pytest.raises(InvalidRequest) as caught:
            check_metadata(bad)
        assert caught.value.param == param


def request(content: str, **fields: object) -> ChatCompletionV2Request:
    return ChatCompletionV2Request.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": content}], **fields}
    )


def test_the_prompt_estimate_is_the_messages_bytes_over_four() -> None:
    short, long = estimate_prompt_tokens(request("hi")), estimate_prompt_tokens(request("x" * 4000))
    assert 0 < short < 20
    assert 999 <= long - short <= 1000
    # Multi-byte text counts its bytes, not its characters.
    assert estimate_prompt_tokens(request("é" * 400)) - short >= 199


def test_tools_count_toward_the_prompt_estimate() -> None:
    description = "d" * 800
    tool = {"type": "function", "function": {"name": "f", "description": description, "parameters": {}}}
    bare, with_tools = (
        estimate_prompt_tokens(request("hi")),
        estimate_prompt_tokens(request("hi", tools=[tool])),
    )
    assert 200 <= with_tools - bare <= 240  # the 800-byte description and the tool's own JSON


def test_a_lines_figure_is_its_prompt_plus_what_it_may_generate() -> None:
    assert line_tokens(request("x", max_tokens=50), 10, 2048, 4096) == 60
    assert line_tokens(request("x", max_tokens=50, max_completion_tokens=70), 10, 2048, 4096) == 80
    assert line_tokens(request("x"), 10, 2048, 4096) == 2048  # the rest of the context
    assert line_tokens(request("x"), 10, None, 4096) == 4106  # no context known: the fallback
    assert line_tokens(request("x"), 3000, 2048, 4096) == 3000
