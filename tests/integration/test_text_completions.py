"""Text completions on the real stack (vLLM on the tiny model): the openai SDK's
`completions.create`, plain and streaming; cancel mid-stream; a batch of `/v1/completions`
lines; and Scale's unchanged `llmengine` client (`Completion.create`, plain and streaming)
run from its own virtual environment (scripts/scale-client.sh) as a subprocess."""

from __future__ import annotations

import io
import json
import os
import subprocess
from pathlib import Path

import httpx
import openai
import pytest
from openai.types import Completion as SdkCompletion

from app.schemas.completion import RecordedStream, TextCompletionChunk
from tests.helpers import ROOT, Stack, events, sdk, wait_batch, wait_for

pytestmark = pytest.mark.integration

PROMPT = "The quick brown fox"


def test_sdk_completions_create_plain(stack: Stack) -> None:
    client = sdk(stack)
    done = client.completions.create(
        model=stack.model, prompt=PROMPT, max_tokens=6, n=2, logprobs=2, temperature=0.8, seed=7
    )
    assert isinstance(done, SdkCompletion) and done.object == "text_completion"
    assert done.id.startswith("cmpl-") and [c.index for c in done.choices] == [0, 1]
    assert done.usage and done.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in done.choices)  # type: ignore[union-attr]
    for choice in done.choices:
        lp = choice.logprobs
        assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs and lp.text_offset
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
        assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)  # the sampled token and 2 alternatives
        assert lp.text_offset[0] == 0 and choice.finish_reason in ("stop", "length")
    # The prompt was encoded as text, with no chat template around it.
    tokenizer_count = done.usage.prompt_tokens  # type: ignore[union-attr]
    assert 4 <= tokenizer_count <= len(PROMPT) + 2


def test_sdk_completions_stream_matches_the_plain_answer(stack: Stack) -> None:
    client = sdk(stack)
    plain = client.completions.create(model=stack.model, prompt=PROMPT, max_tokens=24, temperature=0)
    stream = client.completions.create(
        model=stack.model,
        prompt=PROMPT,
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert all(c.object == "text_completion" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == plain.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens  # type: ignore[union-attr]


def test_echo_token_prompts_and_stop(stack: Stack) -> None:
    client = sdk(stack)
    echoed = client.completions.create(
        model=stack.model, prompt=PROMPT, max_tokens=3, echo=True, temperature=0
    )
    assert echoed.choices[0].text.startswith(PROMPT)
    ids = client.completions.create(model=stack.model, prompt=[[5, 6, 7, 8]], max_tokens=3, temperature=0)
    assert ids.usage and ids.usage.prompt_tokens == 4
    full = client.completions.create(model=stack.model, prompt=PROMPT, max_tokens=30, temperature=0)
    text = full.choices[0].text
    stop = next((text[i : i + 2] for i in range(3, len(text) - 2) if text[i : i + 2].strip()), None)
    if stop is not None and text.find(stop) > 0:
        cut = client.completions.create(
            model=stack.model, prompt=PROMPT, max_tokens=30, temperature=0, stop=[stop]
        )
        assert cut.choices[0].text == text[: text.find(stop)]
        assert cut.choices[0].finish_reason == "stop"


def test_every_text_completion_sampling_field_is_a_sampling_params_field() -> None:
    from vllm import SamplingParams

    from app.schemas.text_completion import CompletionRequest
    from worker.translate import sampling_kwargs

    req = CompletionRequest.model_validate(
        {
            "model": "tiny",
            "prompt": "x",
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 5,
            "min_p": 0.05,
            "seed": 1,
            "stop": ["x"],
            "n": 2,
            "ignore_eos": True,
            "presence_penalty": 0.1,
            "frequency_penalty": 0.1,
            "repetition_penalty": 1.1,
            "logit_bias": {"5": 1},
            "stop_token_ids": [3],
            "include_stop_str_in_output": True,
            "min_tokens": 1,
            "skip_special_tokens": False,
            "spaces_between_special_tokens": False,
            "logprobs": 3,
        }
    )
    kw = sampling_kwargs(req, max_tokens=10, bench=False, structured=None)
    params = SamplingParams(**kw)
    for name, value in kw.items():
        assert getattr(params, name) == value, name
    assert kw["logprobs"] == 3


def test_guided_choice_holds_for_text_completions(stack: Stack) -> None:
    client = sdk(stack)
    done = client.completions.create(
        model=stack.model,
        prompt=PROMPT,
        max_tokens=10,
        n=4,
        temperature=1.0,
        extra_body={"guided_choice": ["yes", "no", "maybe"]},
    )
    assert {c.text for c in done.choices} <= {"yes", "no", "maybe"}


def test_what_the_engine_cannot_honour_is_refused_before_queuing(stack: Stack) -> None:
    client = sdk(stack)
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=stack.model, prompt=PROMPT, suffix="!", max_tokens=3)
    assert raised.value.body["param"] == "suffix"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=stack.model, prompt="word " * 2100, max_tokens=3)
    assert raised.value.body["code"] == "context_length_exceeded"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=stack.model, prompt=[[1, 2, 5000]], max_tokens=3)
    assert raised.value.body["param"] == "prompt"  # type: ignore[index]


def test_a_streamed_completion_is_a_job_that_can_be_cancelled(stack: Stack) -> None:
    body = {"model": stack.model, "prompt": PROMPT, "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with stack.client() as c:
        with c.stream("POST", "/v1/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            job_id = r.headers["X-Llmq-Job-Id"]
            it = events(r)
            first = next(it)
            TextCompletionChunk.model_validate(first.json)
            assert c.post(f"/v2/jobs/{job_id}/cancel").json()["status"] in ("cancelled", "running")
            rest = list(it)
        assert rest[-1].done
        assert any(not e.done and e.json.get("error", {}).get("code") == "job_cancelled" for e in rest)
        job = wait_for(c, [job_id])[job_id]
        assert job["status"] == "cancelled"
        assert job["response"]["object"] == "text_completion"
        assert 0 < job["usage"]["completion_tokens"] < 1500  # the partial text is kept
        recorded = RecordedStream.model_validate(c.get(f"/v2/jobs/{job_id}/events").json())
        assert recorded.events and all(e.object == "text_completion" for e in recorded.events)


def test_a_batch_of_completion_lines(stack: Stack) -> None:
    client = sdk(stack)
    lines = [
        {
            "custom_id": f"c-{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": stack.model, "prompt": f"Line {i} says", "max_tokens": 4},
        }
        for i in range(12)
    ]
    lines[5]["body"]["prompt"] = "word " * 2100  # over the context: fails alone, when it runs
    data = "".join(json.dumps(x) + "\n" for x in lines).encode()
    uploaded = client.files.create(file=("c.jsonl", io.BytesIO(data)), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h"
    )
    done = wait_batch(client, batch.id)
    assert done.status == "completed" and done.endpoint == "/v1/completions"
    assert done.request_counts and (done.request_counts.completed, done.request_counts.failed) == (11, 1)
    assert done.output_file_id and done.error_file_id
    output = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    assert [x["custom_id"] for x in output] == [f"c-{i}" for i in range(12) if i != 5]
    for x in output:
        assert SdkCompletion.model_validate(x["response"]["body"]).object == "text_completion"
    errors = [json.loads(x) for x in client.files.content(done.error_file_id).text.splitlines()]
    assert errors[0]["custom_id"] == "c-5"
    assert errors[0]["response"]["body"]["error"]["code"] == "context_length_exceeded"


# --- Scale's llmengine client, unchanged --------------------------------------------------

SCALE_CLIENT = ROOT / ".venv-llmengine" / "bin" / "python"

SCALE_SCRIPT = """
import json, sys
from llmengine import Completion
model, prompt = sys.argv[1], sys.argv[2]
plain = Completion.create(model=model, prompt=prompt, max_new_tokens=8, temperature=0.0,
                          return_token_log_probs=True)
stream = Completion.create(model=model, prompt=prompt, max_new_tokens=8, temperature=0.0, stream=True)
streamed = [r.dict() for r in stream]
try:
    Completion.create(model=model, prompt="hi", max_new_tokens=10**9, temperature=0.5)
    refused = None
except Exception as exc:
    refused = type(exc).__name__
print(json.dumps({"plain": plain.dict(), "stream": streamed, "refused": refused}))
"""


@pytest.fixture(scope="module")
def scale_client() -> Path:
    subprocess.run(["bash", str(ROOT / "scripts" / "scale-client.sh")], check=True, cwd=ROOT)
    return SCALE_CLIENT


def greedy_prompt(stack: Stack) -> str:
    """A prompt whose greedy answer from the tiny model is 8 tokens of visible text (some
    prompts make it stop at once), so the texts compared below say something."""
    client = sdk(stack)
    for prompt in (PROMPT, "Once upon a time", "Hello, my name is", "1 2 3 4", "def main():"):
        done = client.completions.create(model=stack.model, prompt=prompt, max_tokens=8, temperature=0)
        if done.choices[0].finish_reason == "length" and done.choices[0].text.strip():
            return prompt
    raise AssertionError("no prompt with a visible greedy answer")


def test_scale_llmengine_client_unchanged(stack: Stack, scale_client: Path) -> None:
    prompt = greedy_prompt(stack)
    env = {
        **os.environ,
        "LLM_ENGINE_BASE_PATH": stack.url + "/",
        "SCALE_API_KEY": stack.key,
        "LLM_ENGINE_DISABLE_VERSION_CHECK": "true",
    }
    out = subprocess.run(
        [str(scale_client), "-c", SCALE_SCRIPT, stack.model, prompt],
        env=env,
        capture_output=True,
        timeout=300,
        check=True,
    )
    got = json.loads(out.stdout.decode().strip().splitlines()[-1])
    plain, streamed = got["plain"], got["stream"]
    output = plain["output"]
    assert plain["request_id"].startswith("job_")
    assert (
        output["text"].strip() and output["num_completion_tokens"] == 8 and output["num_prompt_tokens"] >= 1
    )
    assert len(output["tokens"]) == output["num_completion_tokens"]
    assert all(isinstance(t["log_prob"], float) for t in output["tokens"])
    assert streamed and all(e["error"] is None for e in streamed)
    assert "".join(e["output"]["text"] for e in streamed) == output["text"]  # greedy: the same text
    assert [e["output"]["finished"] for e in streamed][-1] is True
    assert not any(e["output"]["finished"] for e in streamed[:-1])
    assert streamed[-1]["output"]["num_completion_tokens"] == output["num_completion_tokens"]
    assert got["refused"] == "BadRequestError"
    # The same job records as every other job: the request id reads back as a job.
    with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {stack.key}"}) as c:
        job = c.get(f"/v2/jobs/{plain['request_id']}").json()
    assert job["status"] == "succeeded" and job["generation_stats"]["generation_tps"] > 0
