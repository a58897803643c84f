"""A minimal SSE client for tests: reads events off an httpx stream."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx


@dataclass
class Event:
    id: str | None
    data: str

    @property
    def json(self) -> Any:
        return json.loads(self.data)

    @property
    def done(self) -> bool:
        return self.data == "[DONE]"


def events(response: httpx.Response) -> Iterator[Event]:
    event_id: str | None = None
    data: list[str] = []
    for line in response.iter_lines():
        if line == "":
            if data:
                yield Event(event_id, "\n".join(data))
            event_id, data = None, []
        elif line.startswith(":"):
            continue
        elif line.startswith("id:"):
            event_id = line[3:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].strip())


def read_all(client: httpx.Client, path: str, headers: dict[str, str] | None = None) -> list[Event]:
    with client.stream("GET", path, headers=headers or {}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return list(events(r))


def text_of(evts: list[Event], index: int = 0) -> str:
    out = []
    for e in evts:
        if e.done or "error" in e.json:
            continue
        for choice in e.json["choices"]:
            if choice["index"] == index:
                out.append(choice["delta"].get("content") or "")
    return "".join(out)
