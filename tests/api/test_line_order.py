"""Prefix-aware line order (app/domain/line_order.py): the feeder sends a batch's lines that
share a prompt prefix together; `x_line_order: "input"` keeps file order; the output file
keeps input order whatever order the lines ran in; priorities still come first."""

from __future__ import annotations

import json
import random
import secrets
from typing import Any

import pytest
from flask.testing import FlaskClient
from sqlalchemy import text

from app.services.batch_lifecycle import BatchLifecycle
from tests.helpers import auth, create, jsonl, upload

PROMPTS = [f"You are assistant number {p}. " + "Follow these long instructions. " * 20 for p in range(4)]


class RecordingQueue:
    def __init__(self) -> None:
        self.messages: list[list[str]] = []

    def enqueue_chunk(self, job_ids: list[str], model: str, priority: int) -> None:
        self.messages.append(job_ids)


def shuffled_prompts(n: int, seed: int = 7) -> list[int]:
    """Which system prompt each of `n` lines uses: every prompt equally often, shuffled."""
    which = [i % len(PROMPTS) for i in range(n)]
    random.Random(seed).shuffle(which)
    return which


def prompt_line(i: int, prompt: int, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": f"req-{i}",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": "api-only",
            "messages": [
                {"role": "system", "content": PROMPTS[prompt]},
                {"role": "user", "content": f"question {i}"},
            ],
            "max_tokens": 5,
            **body,
        },
    }


def new_batch(client: FlaskClient, key: str, lines: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    r = upload(client, key, jsonl(lines))
    assert r.status_code == 200, r.get_json()
    r = create(client, key, r.get_json()["id"], **extra)
    assert r.status_code == 200, r.get_json()
    return dict(r.get_json())


def sent_lines(services, batch_id: str) -> list[int]:  # type: ignore[no-untyped-def]
    """Feed once with room for everything; the batch's line numbers in the order sent."""
    queue = RecordingQueue()
    BatchLifecycle(services.db, queue, services.events, window=100_000, chunk=8).feed()  # type: ignore[arg-type]
    suffix = batch_id.removeprefix("batch_")
    return [int(j.rsplit("_", 1)[1]) for m in queue.messages for j in m if suffix in j]


def runs(values: list[int]) -> int:
    """How many runs of equal adjacent values `values` has."""
    return sum(1 for i, v in enumerate(values) if i == 0 or values[i - 1] != v)


@pytest.fixture
def key(services) -> str:  # type: ignore[no-untyped-def]
    return str(services.keys.create_key(f"tenant-order-{secrets.token_hex(3)}"))


def test_lines_sharing_a_system_prompt_are_sent_together_each_group_in_line_order(
    client: FlaskClient, key: str, services
) -> None:
    which = shuffled_prompts(48)
    assert runs(which) > 20  # the file itself interleaves the prompts
    batch = new_batch(client, key, [prompt_line(i, p) for i, p in enumerate(which)])
    assert batch["x_line_order"] == "prefix"
    order = sent_lines(services, batch["id"])
    assert sorted(order) == list(range(1, 49))
    groups = [which[n - 1] for n in order]
    assert runs(groups) == len(PROMPTS), f"prompts interleaved when sent: {groups}"
    for p in range(len(PROMPTS)):
        mine = [n for n in order if which[n - 1] == p]
        assert mine == sorted(mine)


def test_shared_leading_messages_group_hierarchically(client: FlaskClient, key: str, services) -> None:
    """A few-shot block after the system prompt: lines sharing both go together, inside the
    lines sharing the system prompt."""
    shots = [
        [{"role": "user", "content": f"example {s}"}, {"role": "assistant", "content": "ok"}] for s in (0, 1)
    ]
    rng = random.Random(3)
    plan = [(rng.randrange(2), rng.randrange(2)) for _ in range(40)]
    lines = [
        {
            **prompt_line(i, p),
            "body": {
                "model": "api-only",
                "messages": [
                    {"role": "system", "content": PROMPTS[p]},
                    *shots[s],
                    {"role": "user", "content": f"question {i}"},
                ],
                "max_tokens": 5,
            },
        }
        for i, (p, s) in enumerate(plan)
    ]
    batch = new_batch(client, key, lines)
    order = sent_lines(services, batch["id"])
    assert runs([plan[n - 1][0] for n in order]) == 2
    assert runs([plan[n - 1] for n in order]) == 4


def test_a_batch_that_opts_out_is_sent_in_input_order(client: FlaskClient, key: str, services) -> None:
    which = shuffled_prompts(48)
    batch = new_batch(client, key, [prompt_line(i, p) for i, p in enumerate(which)], x_line_order="input")
    assert batch["x_line_order"] == "input"
    assert sent_lines(services, batch["id"]) == list(range(1, 49))
    r = client.get(f"/v1/batches/{batch['id']}", headers=auth(key))
    assert r.get_json()["x_line_order"] == "input"


def test_an_unknown_line_order_is_a_400_naming_it(client: FlaskClient, key: str) -> None:
    file_id = upload(client, key, jsonl([prompt_line(0, 0)])).get_json()["id"]
    r = create(client, key, file_id, x_line_order="random")
    assert r.status_code == 400
    assert r.get_json()["error"]["param"] == "x_line_order"


def test_priority_still_comes_before_the_prefix(client: FlaskClient, key: str, services) -> None:
    """Lines asking for a more urgent priority go first whatever their prefix."""
    which = shuffled_prompts(24)
    urgent = set(range(0, 24, 3))
    lines = [prompt_line(i, p, priority=0 if i in urgent else 10) for i, p in enumerate(which)]
    batch = new_batch(client, key, lines)
    order = sent_lines(services, batch["id"])
    first = {n - 1 for n in order[: len(urgent)]}
    assert first == urgent
    assert runs([which[n - 1] for n in order[len(urgent) :]]) <= len(PROMPTS)


def test_the_output_file_keeps_input_order_when_lines_end_in_prefix_order(
    client: FlaskClient, key: str, services
) -> None:
    which = shuffled_prompts(32)
    batch = new_batch(client, key, [prompt_line(i, p) for i, p in enumerate(which)])
    order = sent_lines(services, batch["id"])
    assert order != sorted(order)
    # End the lines one transaction at a time in the order they were sent, as workers would.
    for n in order:
        with services.db.session() as s:
            s.execute(
                text(
                    "UPDATE jobs SET status = 'succeeded', succeeded_at = now(), "
                    "response = CAST(:response AS json) WHERE batch_id = :batch AND line_no = :n"
                ),
                {
                    "batch": batch["id"],
                    "n": n,
                    "response": json.dumps({"id": f"chatcmpl-{n}", "choices": []}),
                },
            )
    lifecycle = BatchLifecycle(services.db, RecordingQueue(), services.events, window=8, chunk=8)  # type: ignore[arg-type]
    lifecycle.finalize_done()
    done = client.get(f"/v1/batches/{batch['id']}", headers=auth(key)).get_json()
    assert done["status"] == "completed", done
    r = client.get(f"/v1/files/{done['output_file_id']}/content", headers=auth(key))
    ids = [json.loads(x)["custom_id"] for x in r.get_data(as_text=True).splitlines()]
    assert ids == [f"req-{i}" for i in range(32)]
