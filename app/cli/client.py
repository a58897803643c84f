"""A small HTTP client for the CLI commands that talk to a running llmq."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx


class ApiError(RuntimeError):
    def __init__(self, status: int, body: Any) -> None:
        err = body.get("error", {}) if isinstance(body, dict) else {}
        message = err.get("message") or str(body)
        param = f" (param: {err['param']})" if err.get("param") else ""
        super().__init__(f"HTTP {status}: {message}{param}")
        self.status = status
        self.body = body


@dataclass(frozen=True)
class ResultEvent:
    """One event of a followed batch's results: a line (with its cursor), or, last, the
    ended batch (`line` None)."""

    cursor: str | None
    line: dict[str, Any] | None = None
    batch: dict[str, Any] | None = None


def sse_events(lines: Iterator[str]) -> Iterator[tuple[str | None, str | None, str]]:
    """(id, event name, data) per server-sent event; comments (keep-alives) skipped."""
    event_id: str | None = None
    name: str | None = None
    data: list[str] = []
    for raw in lines:
        if raw == "":
            if data:
                yield event_id, name, "\n".join(data)
            event_id, name, data = None, None, []
            continue
        field, _, value = raw.partition(":")
        value = value.removeprefix(" ")
        if field == "id":
            event_id = value
        elif field == "event":
            name = value
        elif field == "data":
            data.append(value)


def reconnect_wait(failures: int) -> float:
    """Seconds to wait before trying again after `failures` in a row to reach the API
    (a restart takes seconds): 2, 4, 8... and 30 at most."""
    return min(2.0**failures, 30.0)


class LlmqClient:
    def __init__(self, base_url: str, api_key: str, *, timeout: float = 60.0) -> None:
        self._http = httpx.Client(
            base_url=base_url.rstrip("/"),
            headers={"Authorization": f"Bearer {api_key}"},
            timeout=timeout,
        )

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self._http.request(method, path, **kwargs)
        try:
            body = response.json()
        except ValueError:
            body = response.text
        if response.status_code >= 400:
            raise ApiError(response.status_code, body)
        return body

    def submit_job(self, body: dict[str, Any]) -> dict[str, Any]:
        return dict(self.request("POST", "/v2/jobs", json=body))

    def get_job(self, job_id: str) -> dict[str, Any]:
        return dict(self.request("GET", f"/v2/jobs/{job_id}"))

    def upload_batch_file(self, path: Path) -> dict[str, Any]:
        with path.open("rb") as f:
            return dict(
                self.request("POST", "/v1/files", data={"purpose": "batch"}, files={"file": (path.name, f)})
            )

    def create_batch(
        self,
        file_id: str,
        *,
        window: str,
        endpoint: str = "/v1/chat/completions",
        line_order: str | None = None,
    ) -> dict[str, Any]:
        """`line_order`: llmq's `x_line_order` ("prefix", the default, or "input")."""
        body = {"input_file_id": file_id, "endpoint": endpoint, "completion_window": window}
        if line_order is not None:
            body["x_line_order"] = line_order
        return dict(self.request("POST", "/v1/batches", json=body))

    def get_batch(self, batch_id: str) -> dict[str, Any]:
        return dict(self.request("GET", f"/v1/batches/{batch_id}"))

    def cancel_batch(self, batch_id: str) -> dict[str, Any]:
        return dict(self.request("POST", f"/v1/batches/{batch_id}/cancel"))

    def webhooks(self, method: str, path: str = "", **kwargs: Any) -> dict[str, Any]:
        """`/v1/webhook_endpoints` + `path`."""
        return dict(self.request(method, f"/v1/webhook_endpoints{path}", **kwargs))

    def follow_results(
        self, batch_id: str, *, after: str | None = None, reconnects: int = 5
    ) -> Iterator[ResultEvent]:
        """A batch's ended lines as they come (after cursor `after`), then the ended batch.
        A dropped connection is resumed after the last line received (`Last-Event-ID`);
        after `reconnects` drops in a row without an event, the iterator just stops.

        Raises:
            ApiError: the service refused (no such batch, a revoked key, ...).
        """
        cursor, failures = after, 0
        while failures <= reconnects:
            headers = {"Accept": "text/event-stream", **({"Last-Event-ID": cursor} if cursor else {})}
            try:
                with self._http.stream("GET", f"/v1/batches/{batch_id}/results", headers=headers) as r:
                    if r.status_code >= 400:
                        r.read()
                        raise ApiError(r.status_code, r.json())
                    for event_id, name, data in sse_events(r.iter_lines()):
                        failures = 0
                        if data == "[DONE]":
                            return
                        body = json.loads(data)
                        if name == "batch":
                            yield ResultEvent(cursor, batch=body)
                        elif "error" in body and "custom_id" not in body:
                            raise ApiError(200, body)
                        else:
                            cursor = event_id or cursor
                            yield ResultEvent(cursor, line=body)
            except httpx.TransportError:
                pass
            failures += 1  # the connection dropped (or closed) before the end
            time.sleep(reconnect_wait(failures))

    def download(self, file_id: str, path: Path) -> int:
        """Stream a file's content to `path`; returns the number of lines."""
        lines = 0
        with self._http.stream("GET", f"/v1/files/{file_id}/content") as r:
            if r.status_code >= 400:
                r.read()
                raise ApiError(r.status_code, r.json())
            with path.open("wb") as out:
                for chunk in r.iter_bytes():
                    out.write(chunk)
                    lines += chunk.count(b"\n")
        return lines

    def close(self) -> None:
        self._http.close()
