"""In-memory fakes of llmq's own ports, for unit tests of the runner."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from worker.store import Claim


class FakeStore:
    """The JobStore contract: claim bumps the epoch; writes are fenced by it."""

    def __init__(self) -> None:
        self.jobs: dict[str, dict[str, Any]] = {}

    def add(self, job_id: str, request: dict[str, Any], kind: str = "chat") -> None:
        self.jobs[job_id] = {"status": "queued", "epoch": 0, "attempts": 0, "request": request, "kind": kind}

    def claim(self, job_id: str, owner: str, lease_seconds: float, max_attempts: int) -> Claim | None:
        job = self.jobs.get(job_id)
        if job is None or job["status"] != "queued" or job["attempts"] >= max_attempts:
            return None
        job.update(status="running", epoch=job["epoch"] + 1, attempts=job["attempts"] + 1, owner=owner)
        return Claim(
            job_id,
            job["epoch"],
            job["attempts"],
            job["kind"],
            "m",
            0,
            "t",
            job["request"],
            datetime.now(UTC),
            None,
        )

    def _finish(self, job_id: str, epoch: int, **values: Any) -> bool:
        job = self.jobs[job_id]
        if job["epoch"] != epoch or job["status"] != "running":
            return False
        job.update(values)
        return True

    def succeed(self, job_id: str, epoch: int, **values: Any) -> bool:
        return self._finish(job_id, epoch, status="succeeded", **values)

    def fail(self, job_id: str, epoch: int, error: dict[str, Any], events: Any = None) -> bool:
        return self._finish(job_id, epoch, status="failed", error=error, events=events)

    def cancel(self, job_id: str, epoch: int, **values: Any) -> bool:
        return self._finish(job_id, epoch, status="cancelled", **values)

    def release(self, job_id: str, epoch: int) -> bool:
        return self._finish(job_id, epoch, status="queued")


class FakeStreams:
    """The StreamPublisher contract, in memory: what would have been shipped to Redis."""

    flush_tokens = 4
    flush_seconds = 10.0

    def __init__(self) -> None:
        self.shipped: dict[str, list[dict[str, Any]]] = {}
        self.discarded: list[str] = []

    def open(self, job_id: str, epoch: int, header: dict[str, Any], *, n: int = 1) -> Any:
        from worker.streaming import JobStream

        self.shipped[job_id] = []
        return JobStream(self, job_id, epoch, header, n=n)  # type: ignore[arg-type]

    def submit(self, job_id: str, event: dict[str, Any], *, final: bool = False) -> None:
        self.shipped[job_id].append(event)

    def discard(self, job_id: str) -> None:
        self.discarded.append(job_id)

    @property
    def ended(self) -> list[tuple[str, str]]:
        return [
            (j, e["status"]) for j, events in self.shipped.items() for e in events if e.get("type") == "end"
        ]
