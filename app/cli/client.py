"""A small HTTP client for the CLI commands that talk to a running llmq."""

from __future__ import annotations

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
        self, file_id: str, *, window: str, endpoint: str = "/v1/chat/completions"
    ) -> dict[str, Any]:
        body = {"input_file_id": file_id, "endpoint": endpoint, "completion_window": window}
        return dict(self.request("POST", "/v1/batches", json=body))

    def get_batch(self, batch_id: str) -> dict[str, Any]:
        return dict(self.request("GET", f"/v1/batches/{batch_id}"))

    def cancel_batch(self, batch_id: str) -> dict[str, Any]:
        return dict(self.request("POST", f"/v1/batches/{batch_id}/cancel"))

    def webhooks(self, method: str, path: str = "", **kwargs: Any) -> dict[str, Any]:
        """`/v1/webhook_endpoints` + `path`."""
        return dict(self.request(method, f"/v1/webhook_endpoints{path}", **kwargs))

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
