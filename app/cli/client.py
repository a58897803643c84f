"""A small HTTP client for the CLI commands that talk to a running llmq."""

from __future__ import annotations

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

    def close(self) -> None:
        self._http.close()
