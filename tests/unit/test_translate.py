from __future__ import annotations

import pytest

from app.errors import InvalidRequest
from app.schemas.chat import ChatCompletionV2Request
from worker.translate import translate


class FixedRenderer:
    def __init__(self, length: int) -> None:
        self.length = length

    def render(self, req: ChatCompletionV2Request) -> list[int]:
        return list(range(self.length))


def run(fields: dict, *, prompt: int = 10, context: int = 100, kind: str = "chat"):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return translate(body, request_id="r", kind=kind, renderer=FixedRenderer(prompt), max_model_len=context)[
        1
    ]


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
