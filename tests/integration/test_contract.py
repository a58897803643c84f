"""The ChatCompletionV2 contract on the real engine (vLLM CPU, tiny model): each honoured
field changes the output as documented; structured outputs always hold; response shapes
are the seeds'. (The 400s for what is not honoured are in tests/unit/test_contract.py and
tests/api.)"""

from __future__ import annotations

import json
import re
import time
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from tokenizers import Tokenizer

from app.schemas.completion import BenchChatCompletion, ChatCompletionChunk
from tests.helpers import TINY_DIR, Stack, body, pick_stop, read_all, run, run_many

pytestmark = pytest.mark.integration

EOS = 2  # <|im_end|> in the tiny tokenizer
IM_START = 1


def text(job: dict[str, Any], index: int = 0) -> str:
    assert job["status"] == "succeeded", job
    return str(job["response"]["choices"][index]["message"]["content"])


# --- the translation against vLLM's own SamplingParams ----------------------------------


def test_every_sampling_field_is_a_sampling_params_field() -> None:
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    from app.schemas.chat import ChatCompletionV2Request
    from worker.translate import sampling_kwargs

    req = ChatCompletionV2Request.model_validate(
        body(
            Stack("", "", "tiny", None, {}),  # type: ignore[arg-type]
            temperature=0.7,
            top_p=0.9,
            top_k=5,
            min_p=0.05,
            seed=1,
            stop=["x"],
            n=2,
            ignore_eos=True,
            presence_penalty=0.1,
            frequency_penalty=0.1,
            repetition_penalty=1.1,
            logit_bias={"5": 1},
            stop_token_ids=[3],
            include_stop_str_in_output=True,
            min_tokens=1,
            skip_special_tokens=False,
            spaces_between_special_tokens=False,
            logprobs=True,
            top_logprobs=3,
        )
    )
    kw = sampling_kwargs(req, max_tokens=10, bench=False, structured={"regex": "a+"})
    structured = kw.pop("structured_outputs")
    params = SamplingParams(**kw, structured_outputs=StructuredOutputsParams(**structured))
    for name, value in kw.items():
        assert getattr(params, name) == value, name


# --- structured outputs: always valid, over 20 seeds --------------------------------------

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "member": {"type": "boolean"},
    },
    "required": ["name", "age", "member"],
    "additionalProperties": False,
}


def seeds(stack: Stack, **fields: Any) -> list[dict[str, Any]]:
    return run_many(
        stack, [body(stack, seed=s, temperature=1.0, max_tokens=120, **fields) for s in range(20)]
    )


def test_guided_regex_always_full_matches(stack: Stack) -> None:
    for job in seeds(stack, guided_regex="[a-z]{3,8}-[0-9]{2}"):
        assert re.fullmatch("[a-z]{3,8}-[0-9]{2}", text(job)), text(job)


def test_guided_choice_always_one_of_them(stack: Stack) -> None:
    for job in seeds(stack, guided_choice=["red", "green", "blue"]):
        assert text(job) in {"red", "green", "blue"}


def test_guided_json_always_parses_strictly_and_validates(stack: Stack) -> None:
    for job in seeds(stack, guided_json=PERSON):
        jsonschema.validate(json.loads(text(job), strict=True), PERSON)


def test_response_format_json_schema_always_validates(stack: Stack) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for job in seeds(stack, response_format=fmt):
        jsonschema.validate(json.loads(text(job), strict=True), PERSON)


def test_guided_grammar_and_json_object(stack: Stack) -> None:
    for job in seeds(stack, guided_grammar='root ::= "yes" | "no" | "maybe"')[:5]:
        assert text(job) in {"yes", "no", "maybe"}
    # Left alone, the tiny model writes one endless key and the budget cuts it (which
    # checked nothing before); biased toward `}`, the object ends, so the check runs.
    close = Tokenizer.from_file(str(TINY_DIR / "tokenizer.json")).token_to_id("}")
    biased = {str(close): 100}
    job = run(stack, response_format={"type": "json_object"}, logit_bias=biased, max_tokens=50, temperature=0)
    assert job["response"]["choices"][0]["finish_reason"] == "stop", text(job)
    assert isinstance(json.loads(text(job), strict=True), dict)


# --- sampling ---------------------------------------------------------------------------


def test_n_logprobs_and_max_tokens(stack: Stack) -> None:
    job = run(
        stack, n=3, max_tokens=7, ignore_eos=True, logprobs=True, top_logprobs=5, temperature=1.0, seed=4
    )
    choices = job["response"]["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert all(c["finish_reason"] == "length" for c in choices)
    assert job["usage"]["completion_tokens"] == 21
    for c in choices:
        content = c["logprobs"]["content"]
        assert len(content) == 7
        for entry in content:
            assert len(entry["top_logprobs"]) == 5
            assert entry["logprob"] <= 0 and isinstance(entry["bytes"], list)
            assert all(t["logprob"] <= 0 for t in entry["top_logprobs"])
        # The bytes of the tokens spell the text, multi-byte characters split or not.
        assert (
            bytes(b for e in content for b in e["bytes"]).decode("utf-8", "replace")
            == c["message"]["content"]
        )
    plain = run(stack, max_tokens=3)
    assert plain["response"]["choices"][0]["logprobs"] is None


def test_seed_is_reproducible_even_when_batched(stack: Stack) -> None:
    alone = text(run(stack, seed=77, temperature=1.0, max_tokens=20, ignore_eos=True))
    crowd = [body(stack, seed=s, temperature=1.0, max_tokens=60, ignore_eos=True) for s in range(8)]
    batched = run_many(
        stack, [*crowd[:4], body(stack, seed=77, temperature=1.0, max_tokens=20, ignore_eos=True), *crowd[4:]]
    )
    assert text(batched[4]) == alone


def test_logit_bias_stop_token_ids_and_min_tokens(stack: Stack) -> None:
    forced = run(
        stack, logit_bias={"300": 100}, max_tokens=5, ignore_eos=True, logprobs=True, temperature=1.0
    )
    tokens = [e["token"] for e in forced["response"]["choices"][0]["logprobs"]["content"]]
    assert len(set(tokens)) == 1 and len(tokens) == 5
    stopped = run(stack, logit_bias={"300": 100}, stop_token_ids=[300], max_tokens=5)
    assert stopped["usage"]["completion_tokens"] == 1
    assert stopped["response"]["choices"][0]["finish_reason"] == "stop"
    eos_now = run(stack, logit_bias={str(EOS): 100}, max_tokens=10)
    assert eos_now["usage"]["completion_tokens"] == 1
    held = run(stack, logit_bias={str(EOS): 100}, min_tokens=6, max_tokens=10)
    assert held["usage"]["completion_tokens"] >= 6


def test_penalties_change_greedy_output(stack: Stack) -> None:
    base = text(run(stack, temperature=0, max_tokens=60, ignore_eos=True))
    for knob in ({"repetition_penalty": 2.0}, {"presence_penalty": 2.0}, {"frequency_penalty": 2.0}):
        assert text(run(stack, temperature=0, max_tokens=60, ignore_eos=True, **knob)) != base, knob


def test_stop_string_kept_with_include_stop_str_in_output(stack: Stack) -> None:
    seeded = {"temperature": 1.0, "seed": 11, "max_tokens": 40}
    full = text(run(stack, ignore_eos=True, **seeded))
    cut = pick_stop(full)
    kept = text(run(stack, stop=[cut], include_stop_str_in_output=True, **seeded))
    dropped = text(run(stack, stop=[cut], **seeded))
    assert kept == dropped + cut


def test_special_token_flags(stack: Stack) -> None:
    forced = {"logit_bias": {str(IM_START): 100}, "max_tokens": 3, "ignore_eos": True}
    assert text(run(stack, **forced)) == ""
    shown = text(run(stack, skip_special_tokens=False, **forced))
    assert shown.count("<|im_start|>") == 3
    spaced = text(run(stack, skip_special_tokens=False, spaces_between_special_tokens=True, **forced))
    tight = text(run(stack, skip_special_tokens=False, spaces_between_special_tokens=False, **forced))
    # vLLM's fast detokenizer inserts no spaces between special tokens for a byte-level BPE
    # either way; the flag only removes spaces a tokenizer's own decoder would add (the
    # field reaching SamplingParams is checked in test_every_sampling_field_...).
    assert tight == spaced == "<|im_start|>" * 3


def test_bench_returns_seed_000_with_stats(stack: Stack) -> None:
    with stack.client() as c:
        r = c.post("/bench/chat/completions", json=body(stack, max_tokens=16))
    assert r.status_code == 200, r.text
    bench = BenchChatCompletion.model_validate(r.json())
    assert bench.usage is not None and bench.usage.completion_tokens == 16  # EOS ignored, exact count
    assert bench.generation_stats is not None and bench.generation_stats.generation_tokens == 16
    assert bench.generation_stats.generation_tps > 0 and bench.generation_stats.prompt_tps > 0
    assert bench.generation_stats.peak_memory_usage.inBytes > 0
    assert bench.power_usage is None  # no sensor on a CPU worker
    with stack.client() as c:
        r = c.post("/bench/chat/completions", json=body(stack))
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_prefix_cache_shows_as_cached_tokens(stack: Stack) -> None:
    long = "The quick brown fox jumps over the lazy dog. " * 40
    first = run(stack, messages=[{"role": "user", "content": long}], max_tokens=2)
    second = run(stack, messages=[{"role": "user", "content": long}], max_tokens=2)
    assert first["usage"]["prompt_tokens"] > 256
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 128


# --- templates --------------------------------------------------------------------------


def test_generation_prompt_continue_and_echo(stack: Stack) -> None:
    convo = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, I am"}]
    gen = run(stack, messages=convo, max_tokens=2)
    cont = run(stack, messages=convo, max_tokens=2, continue_final_message=True, add_generation_prompt=False)
    no_gen = run(stack, messages=convo, max_tokens=2, add_generation_prompt=False)
    # ChatML: the generation prompt adds `<|im_start|>assistant\n`; continuing drops the
    # final `<|im_end|>\n` too.
    assert gen["usage"]["prompt_tokens"] > no_gen["usage"]["prompt_tokens"] > cont["usage"]["prompt_tokens"]
    echoed = run(
        stack,
        messages=convo,
        max_tokens=4,
        continue_final_message=True,
        add_generation_prompt=False,
        echo=True,
    )
    assert text(echoed).startswith("Hello, I am")


def test_custom_chat_template_is_sandboxed(stack: Stack) -> None:
    plain = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    job = run(stack, chat_template=plain, max_tokens=2)
    assert job["status"] == "succeeded"
    escape = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    assert run(stack, chat_template=escape, max_tokens=2)["error"]["param"] == "chat_template"
    bomb = "{% for i in range(100000) %}{% for j in range(100000) %}{{ i }}{% endfor %}{% endfor %}"
    started = time.monotonic()
    failed = run(stack, chat_template=bomb, max_tokens=2)
    assert failed["status"] == "failed" and "within" in failed["error"]["message"]
    assert time.monotonic() - started < 60
    assert run(stack, max_tokens=2)["status"] == "succeeded"


# --- tools ------------------------------------------------------------------------------

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER},
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}},
                "required": ["tz"],
                "additionalProperties": False,
            },
        },
    },
]


def test_named_tool_choice_on_any_model(stack: Stack) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    job = run(stack, tools=TOOLS, tool_choice=named, max_tokens=80, temperature=0)
    choice = job["response"]["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert (
        call["type"] == "function"
        and call["function"]["name"] == "get_weather"
        and call["id"].startswith("call_")
    )
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER)
    # Streamed: the arguments arrive as deltas that join to the same string, same id.
    with (
        stack.client() as c,
        c.stream(
            "POST",
            "/v1/chat/completions",
            json=body(stack, tools=TOOLS, tool_choice=named, max_tokens=80, temperature=0, stream=True),
        ) as r,
    ):
        from tests.helpers import events

        evts = [e for e in events(r) if not e.done]
    deltas = [d for e in evts for ch in e.json["choices"] for d in (ch["delta"].get("tool_calls") or [])]
    assert deltas[0]["id"] and deltas[0]["function"]["name"] == "get_weather"
    assert "".join(d["function"]["arguments"] for d in deltas) == call["function"]["arguments"]
    assert evts[-1].json["choices"][0]["finish_reason"] == "tool_calls"
    for e in evts:
        ChatCompletionChunk.model_validate(e.json)


def test_required_tool_choice_and_legacy_functions(stack: Stack) -> None:
    # One call at most (no parallel calls) keeps every output within max_tokens, so every
    # seed is checked: none may end cut by the budget.
    jobs = run_many(
        stack,
        [
            body(
                stack,
                tools=TOOLS,
                tool_choice="required",
                parallel_tool_calls=False,
                max_tokens=150,
                seed=s,
                temperature=1.0,
            )
            for s in range(5)
        ],
    )
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
    for job in jobs:
        choice = job["response"]["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        (call,) = choice["message"]["tool_calls"]
        jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])
    legacy = run(
        stack,
        functions=[TOOLS[0]["function"]],
        function_call={"name": "get_weather"},
        max_tokens=80,
        temperature=0,
    )
    choice = legacy["response"]["choices"][0]
    assert choice["finish_reason"] == "function_call" and choice["message"]["tool_calls"] is None
    assert choice["message"]["function_call"]["name"] == "get_weather"
    json.loads(choice["message"]["function_call"]["arguments"])


def test_tool_results_render_through_the_template(stack: Stack) -> None:
    convo = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
    ]
    job = run(stack, messages=convo, tools=TOOLS, tool_choice="none", max_tokens=5)
    assert job["status"] == "succeeded"
    assert (
        job["usage"]["prompt_tokens"] > run(stack, messages=convo[:1], max_tokens=1)["usage"]["prompt_tokens"]
    )


def test_openai_sdk_tools_and_raw_http_errors(stack: Stack) -> None:
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=stack.key, max_retries=0)
    completion = client.chat.completions.create(
        model=stack.model,
        messages=[{"role": "user", "content": "Weather?"}],
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=80,
        temperature=0,
    )
    call = completion.choices[0].message.tool_calls[0]  # type: ignore[index]
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(
            model=stack.model, messages=[{"role": "user", "content": "x"}], tools=TOOLS
        )  # type: ignore[arg-type]
    assert exc.value.body["param"] == "tool_choice"  # type: ignore[index]
    with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {stack.key}"}) as c:
        r = c.post("/v1/chat/completions", json=body(stack, use_beam_search=True))
        assert r.status_code == 400 and r.json()["error"]["param"] == "use_beam_search"
        long = body(stack, messages=[{"role": "user", "content": "word " * 3000}])
        r = c.post("/v1/chat/completions", json=long)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_stream_logprobs_and_n(stack: Stack) -> None:
    with stack.client() as c:
        evts = read_all(
            c,
            "/v2/jobs/"
            + c.post(
                "/v2/jobs",
                json=body(stack, n=2, logprobs=True, top_logprobs=2, max_tokens=12, ignore_eos=True),
            ).json()["id"]
            + "/stream",
        )
    per_choice: dict[int, int] = {0: 0, 1: 0}
    for e in evts:
        if e.done:
            continue
        for ch in e.json["choices"]:
            if ch["logprobs"]:
                per_choice[ch["index"]] += len(ch["logprobs"]["content"])
                assert all(len(x["top_logprobs"]) == 2 for x in ch["logprobs"]["content"])
    assert per_choice == {0: 12, 1: 12}
