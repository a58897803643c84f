"""`llmq batch submit --wait` rides out an API restart (a crash its supervisor restarts in
seconds while the batch runs on): polls that cannot reach the API are tried again, with
growing waits, and only a run of failures past the limit ends the command."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from app.cli.batch import follow

pytestmark = pytest.mark.unit


def batch(status: str, done: int) -> dict[str, Any]:
    return {
        "id": "batch_x",
        "status": status,
        "request_counts": {"total": 3, "completed": done, "failed": 0},
    }


class Client:
    """Answers from a script: a dict is the batch, an exception is raised."""

    def __init__(self, *script: Any) -> None:
        self.script = list(script)
        self.asked = 0

    def get_batch(self, batch_id: str) -> dict[str, Any]:
        self.asked += 1
        answer = self.script.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return dict(answer)


def test_polls_that_cannot_reach_the_api_are_asked_again_until_it_is_back() -> None:
    reset = httpx.ReadError("[Errno 104] Connection reset by peer")
    refused = httpx.ConnectError("[Errno 111] Connection refused")
    client = Client(batch("in_progress", 1), reset, refused, refused, batch("completed", 3))
    waits: list[float] = []
    final = follow(client, "batch_x", interval=1.0, sleep=waits.append)  # type: ignore[arg-type]
    assert final["status"] == "completed" and client.asked == 5
    assert waits == [1.0, 2.0, 4.0, 8.0]  # the poll interval, then 2, 4, 8 s while it is away


def test_an_api_that_stays_away_ends_the_command_with_its_error() -> None:
    refused = httpx.ConnectError("[Errno 111] Connection refused")
    client = Client(batch("in_progress", 0), *[refused] * 4)
    waits: list[float] = []
    with pytest.raises(httpx.ConnectError):
        follow(client, "batch_x", reconnects=3, sleep=waits.append)  # type: ignore[arg-type]
    assert client.asked == 5 and waits == [1.0, 2.0, 4.0, 8.0]


def test_an_api_error_is_not_asked_again() -> None:
    class Refused(Exception):
        pass

    client = Client(batch("in_progress", 0), Refused("404"))
    with pytest.raises(Refused):
        follow(client, "batch_x", sleep=lambda s: None)  # type: ignore[arg-type]
    assert client.asked == 2
