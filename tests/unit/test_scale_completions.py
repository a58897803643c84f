"""Scale's v1 completions on text completion jobs: the request's translation, the sync
response and the stream relay (the client's event shapes, never a `[DONE]` line)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from app.errors import InvalidRequest
from app.schemas.scale import CompletionStreamV1Response, CompletionSyncV1Request, CompletionSyncV1Response
from app.services.scale_completions import _renamed, relay, sync_response, to_completion_request
from app.services.sse import DONE, HEARTBEAT, frame


def chunk(text: str, *, tokens: list[str] | None = None, finish: str | None = None) -> dict[str, Any]:
    logprobs = (
        {
            "tokens": tokens,
            "token_logprobs": [-0.5] * len(tokens),
            "top_logprobs": [{t: -0.5} for t in tokens],
            "text_offset": [0] * len(tokens),
        }
        if tokens is not None
        else None
    )
    choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
    return {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m", "choices": [choice]}


USAGE = {
    "id": "cmpl-1",
    "object": "text_completion",
    "created": 1,
    "model": "m",
    "choices": [],
    "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
}


def events(frames: list[str], *, logprobs: bool = False) -> list[dict[str, Any]]:
    out = list(relay("job_1", iter(frames), logprobs=logprobs))
    assert all("[DONE]" not in f for f in out)
    parsed = [json.loads(f.removeprefix("data: ")) for f in out if f.startswith("data: ")]
    for p in parsed:
        CompletionStreamV1Response.model_validate(p)
    return parsed


def test_the_last_output_is_finished_and_carries_both_counts() -> None:
    got = events(
        [
            frame(chunk("a b"), "1-1"),
            HEARTBEAT,
            frame(chunk(" c", finish="length"), "1-2"),
            frame(USAGE, "1-3"),
            DONE,
        ]
    )
    assert [e["output"]["text"] for e in got] == ["a b", " c"]
    assert [e["output"]["finished"] for e in got] == [False, True]
    assert got[-1]["output"]["num_prompt_tokens"] == 5 and got[-1]["output"]["num_completion_tokens"] == 3
    assert {e["request_id"] for e in got} == {"job_1"}


def test_frames_written_as_one_piece_relay_as_they_do_one_by_one() -> None:
    """The job's stream writes the events it read at once as one piece (app/services/streaming.py)."""
    frames = [frame(chunk("a b"), "1-1"), HEARTBEAT, frame(chunk(" c", finish="length"), "1-2")]
    one_by_one = events([*frames, frame(USAGE, "1-3"), DONE])
    pieces = events(["".join(frames), frame(USAGE, "1-3") + DONE])
    assert [e["output"] for e in pieces] == [e["output"] for e in one_by_one]
    assert [e["output"]["text"] for e in pieces] == ["a b", " c"]


def test_with_log_probabilities_each_token_is_an_event() -> None:
    got = events(
        [
            frame(chunk("a b", tokens=["a", " b"]), "1-1"),
            frame(chunk(" c", tokens=[" c"], finish="stop"), "1-2"),
            frame(USAGE, "1-3"),
            DONE,
        ],
        logprobs=True,
    )
    assert [e["output"]["token"] for e in got] == [
        {"token": "a", "log_prob": -0.5},
        {"token": " b", "log_prob": -0.5},
        {"token": " c", "log_prob": -0.5},
    ]
    assert [e["output"]["num_completion_tokens"] for e in got] == [1, 2, 3]
    assert got[-1]["output"]["finished"] is True


def test_an_error_ends_the_stream_in_the_clients_error_shape() -> None:
    error = {"message": "the job was cancelled", "type": "cancelled", "param": None, "code": "job_cancelled"}
    got = events([frame(chunk("a"), "1-1"), "id: 1-2\ndata: " + json.dumps({"error": error}) + "\n\n", DONE])
    assert got[0]["output"]["text"] == "a"
    assert got[1]["error"]["status_code"] == 409
    assert got[1]["error"]["content"]["error"] == "the job was cancelled"


def test_sync_response_shape() -> None:
    completion = {
        **chunk("hello", tokens=["hel", "lo"], finish="stop"),
        "usage": {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4},
    }
    body = CompletionSyncV1Response.model_validate(sync_response("job_9", completion))
    assert body.request_id == "job_9" and body.output.text == "hello"
    assert body.output.num_prompt_tokens == 2 and body.output.num_completion_tokens == 2
    assert [t.token for t in body.output.tokens or []] == ["hel", "lo"]


def test_translation_keeps_every_field_and_sets_nothing_else() -> None:
    scale = CompletionSyncV1Request.model_validate(
        {
            "prompt": "p",
            "max_new_tokens": 7,
            "temperature": 0.0,
            "stop_sequences": ["x"],
            "return_token_log_probs": True,
            "presence_penalty": 0.5,
            "frequency_penalty": 0.25,
            "top_k": 3,
            "top_p": 0.9,
            "include_stop_str_in_output": True,
            "guided_regex": "[a-z]+",
            "skip_special_tokens": False,
        }
    )
    req = to_completion_request("m", scale)
    assert req.model_dump(exclude_unset=True) == {
        "model": "m",
        "prompt": "p",
        "max_tokens": 7,
        "temperature": 0.0,
        "stop": ["x"],
        "logprobs": 0,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.25,
        "top_k": 3,
        "top_p": 0.9,
        "include_stop_str_in_output": True,
        "guided_regex": "[a-z]+",
        "skip_special_tokens": False,
    }


@pytest.mark.parametrize(
    ("param", "scale"),
    [("max_tokens", "max_new_tokens"), ("stop", "stop_sequences"), ("model", "model_endpoint_name")],
)
def test_errors_name_the_scale_field(param: str, scale: str) -> None:
    renamed = _renamed(InvalidRequest(f"`{param}` is wrong", param=param))
    assert renamed.param == scale and f"`{scale}`" in renamed.message
