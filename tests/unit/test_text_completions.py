"""Text completions in the worker and at the door: a `completion` job runs its prompt
without a template and answers OpenAI's `text_completion` shapes (checked against
openai-python's own types); the policy refuses what the engine cannot honour."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from openai.types import Completion as OpenAICompletion

from app.errors import InvalidRequest, LlmqError, NotFound, Unsupported
from app.schemas.completion import TextCompletion, TextCompletionChunk
from app.schemas.text_completion import CompletionRequest
from app.services.completion_contract import CompletionPolicy
from app.settings import Settings
from tests.unit.fakes import FakeStore, FakeStreams, fake_runner, served
from worker.engine import InstantEngine
from worker.loop import LoopThread


@pytest.fixture
def loop() -> Iterator[LoopThread]:
    lt = LoopThread()
    lt.start()
    yield lt
    lt.stop()


def run_completion_with(
    loop: LoopThread, engine: InstantEngine, request: dict[str, Any]
) -> tuple[dict[str, Any], FakeStreams]:
    store, streams = FakeStore(), FakeStreams()
    store.add("job_1", {"model": "m", **request}, kind="completion")
    runner = fake_runner(store, loop, engine=engine, streams=streams)
    runner.run("job_1")
    return store.jobs["job_1"], streams


def run_completion(
    loop: LoopThread, request: dict[str, Any], **engine: Any
) -> tuple[dict[str, Any], FakeStreams]:
    return run_completion_with(loop, InstantEngine(**engine), request)


def test_a_completion_job_answers_text_completion(loop: LoopThread) -> None:
    job, streams = run_completion(loop, {"prompt": "hello", "max_tokens": 3, "n": 2})
    assert job["status"] == "succeeded"
    body = TextCompletion.model_validate(job["response"])
    assert body.id == "cmpl-1" and body.object == "text_completion"
    assert [c.index for c in body.choices] == [0, 1]
    assert body.choices[0].text == "tok0 tok1 tok2"
    assert body.choices[0].finish_reason == "length" and body.choices[0].logprobs is None
    # The prompt is its bytes under ByteRenderer: no chat template around it.
    assert job["usage"]["prompt_tokens"] == len(b"hello")
    assert OpenAICompletion.model_validate(job["response"]).choices[1].text == "tok0 tok1 tok2"
    chunks = [e["data"] for e in streams.shipped["job_1"] if e.get("type") == "chunk"]
    assert chunks and all(TextCompletionChunk.model_validate(c).object == "text_completion" for c in chunks)
    streamed = "".join(ch["text"] for c in chunks for ch in c["choices"] if ch["index"] == 0)
    assert streamed == "tok0 tok1 tok2"
    assert chunks[-1]["choices"][-1]["finish_reason"] == "length"


def test_default_max_tokens_is_openais_16(loop: LoopThread) -> None:
    job, _ = run_completion(loop, {"prompt": "hi"})
    assert job["usage"]["completion_tokens"] == 16


def test_echo_puts_the_prompt_first_and_token_prompts_are_decoded(loop: LoopThread) -> None:
    job, streams = run_completion(loop, {"prompt": "say", "echo": True, "max_tokens": 2})
    assert job["response"]["choices"][0]["text"] == "saytok0 tok1"
    first = next(e["data"] for e in streams.shipped["job_1"] if e.get("type") == "chunk")
    assert first["choices"][0]["text"].startswith("saytok0")
    job, _ = run_completion(loop, {"prompt": [[104, 105]], "echo": True, "max_tokens": 1})
    assert job["response"]["choices"][0]["text"] == "hitok0"
    assert job["usage"]["prompt_tokens"] == 2


class LogprobEngine(InstantEngine):
    """InstantEngine with a logprob per token, as vLLM gives when `logprobs` is asked."""

    async def generate(self, spec: Any) -> Any:
        from worker.engine import TokenLogprob

        async for update in super().generate(spec):
            for d in update.deltas:
                if d.text:
                    d.logprobs = [
                        TokenLogprob(d.text, -0.25, None, [(d.text, -0.25, None), ("x", -3.0, None)])
                    ]
            yield update


def test_logprobs_have_openais_legacy_shape_with_offsets(loop: LoopThread) -> None:
    job, streams = run_completion_with(loop, LogprobEngine(), {"prompt": "p", "max_tokens": 3, "logprobs": 1})
    lp = job["response"]["choices"][0]["logprobs"]
    assert lp["tokens"] == ["tok0", " tok1", " tok2"]
    assert lp["token_logprobs"] == [-0.25, -0.25, -0.25]
    assert lp["text_offset"] == [0, 4, 9]
    assert lp["top_logprobs"][0] == {"tok0": -0.25, "x": -3.0}
    parsed = OpenAICompletion.model_validate(job["response"]).choices[0].logprobs
    assert parsed is not None and parsed.text_offset == [0, 4, 9]
    offsets = [
        o
        for e in streams.shipped["job_1"]
        if e.get("type") == "chunk"
        for ch in e["data"]["choices"]
        if ch["logprobs"]
        for o in ch["logprobs"]["text_offset"]
    ]
    assert offsets == [0, 4, 9]  # a stream's offsets continue across its chunks


def test_echo_with_logprobs_puts_the_prompts_tokens_first(loop: LoopThread) -> None:
    job, streams = run_completion_with(
        loop, LogprobEngine(), {"prompt": "ab", "echo": True, "logprobs": 1, "max_tokens": 2}
    )
    choice = job["response"]["choices"][0]
    assert choice["text"] == "abtok0 tok1"
    lp = choice["logprobs"]
    assert lp["tokens"] == ["a", "b", "tok0", " tok1"]
    assert lp["token_logprobs"] == [None, -1.0, -0.25, -0.25]  # nothing precedes the first token
    assert lp["top_logprobs"][0] is None and lp["top_logprobs"][1] == {"b": -1.0}
    assert lp["text_offset"] == [0, 1, 2, 6]
    # openai-python types token_logprobs as floats; the API (and vLLM) send null first, which
    # the SDK reads without validating.
    assert TextCompletion.model_validate(job["response"]).choices[0].text == "abtok0 tok1"
    first = next(e["data"] for e in streams.shipped["job_1"] if e.get("type") == "chunk")
    assert first["choices"][0]["logprobs"]["tokens"][:3] == ["a", "b", "tok0"]
    assert first["choices"][0]["logprobs"]["text_offset"][:3] == [0, 1, 2]


def test_a_prompt_over_the_context_fails_naming_prompt(loop: LoopThread) -> None:
    job, _ = run_completion(loop, {"prompt": "x" * 60}, context=50)
    assert job["status"] == "failed"
    assert job["error"]["error"]["param"] == "prompt"
    assert job["error"]["error"]["code"] == "context_length_exceeded"


# --- the policy ----------------------------------------------------------------------

POLICY = CompletionPolicy(
    Settings(_env_file=None, max_n=8, max_tokens_limit=100),  # type: ignore[call-arg]
    served("tiny", max_model_len=64, vocab_size=300, count=lambda req: 10),
)


def check(**fields: Any) -> None:
    POLICY.check(
        CompletionRequest.model_validate({"model": "tiny", "prompt": "hi", **fields}), streaming=True
    )


@pytest.mark.parametrize(
    ("fields", "error", "param"),
    [
        ({"suffix": "end"}, Unsupported, "suffix"),
        ({"prompt": ["a", "b"]}, Unsupported, "prompt"),
        ({"prompt": [[1], [2]]}, Unsupported, "prompt"),
        ({"prompt": ""}, InvalidRequest, "prompt"),
        ({"prompt": [1, 2, 300]}, InvalidRequest, "prompt"),
        ({"best_of": 3, "n": 2}, Unsupported, "best_of"),
        ({"n": 9}, InvalidRequest, "n"),
        ({"max_tokens": 101}, InvalidRequest, "max_tokens"),
        ({"max_tokens": 60}, InvalidRequest, "max_tokens"),  # 10 prompt tokens + 60 > 64
        ({"prompt": list(range(64))}, InvalidRequest, "prompt"),  # token prompts counted here
        ({"logit_bias": {"300": 1}}, InvalidRequest, "logit_bias"),
        ({"stop_token_ids": [999]}, InvalidRequest, "stop_token_ids"),
        ({"use_beam_search": True}, Unsupported, "use_beam_search"),
        ({"guided_whitespace_pattern": " "}, Unsupported, "guided_whitespace_pattern"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, InvalidRequest, "guided_choice"),
        ({"stream_options": {"include_usage": True}}, InvalidRequest, "stream_options"),
        ({"model": "nope"}, NotFound, "model"),
    ],
)
def test_what_the_engine_cannot_honour_is_a_400_naming_the_field(
    fields: dict[str, Any], error: type[LlmqError], param: str
) -> None:
    with pytest.raises(error) as raised:
        check(**fields)
    assert raised.value.param == param


def test_what_it_honours_passes() -> None:
    check(prompt=["one prompt in a list"], n=2, best_of=2, logprobs=5, stop=["\n"], max_tokens=20)
    check(prompt=[1, 2, 3], echo=True, use_beam_search=False, length_penalty=1.0, guided_choice=["a", "b"])
    check(echo=True, logprobs=2)
    check(stream=True, stream_options={"include_usage": True})


def test_a_batch_line_cannot_stream() -> None:
    with pytest.raises(InvalidRequest) as raised:
        POLICY.check(CompletionRequest.model_validate({"model": "tiny", "prompt": "hi", "stream": True}))
    assert raised.value.param == "stream"


def test_unknown_fields_are_refused_by_the_model() -> None:
    from app.services.parsing import parse_model

    with pytest.raises(InvalidRequest) as raised:
        parse_model(CompletionRequest, {"model": "tiny", "prompt": "hi", "messages": []})
    assert raised.value.param == "messages"


def test_the_cli_submits_a_file_under_its_lines_endpoint(tmp_path: Any) -> None:
    from app.cli.batch import endpoint_of

    text_file = tmp_path / "t.jsonl"
    text_file.write_text('{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}}\n')
    assert endpoint_of(text_file) == "/v1/completions"
    odd = tmp_path / "odd.jsonl"
    odd.write_text("not json\n")
    assert endpoint_of(odd) == "/v1/chat/completions"
