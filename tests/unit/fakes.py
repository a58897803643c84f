"""In-memory fakes of llmq's own ports, for unit tests of the runner."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from app.services.contract import ConstraintChecker
from app.services.models import ModelRegistry, ServedModel
from worker.engine import ByteRenderer, Engine, InstantEngine
from worker.loop import LoopThread
from worker.runner import JobRunner, RunnerConfig
from worker.stats import ProcessTree, ResourceSampler, self_pid
from worker.store import Claim, Result
from worker.translate import Renderer


class FakeStore:
    """The JobStore contract: claims bump the epoch; results are fenced by it."""

    def __init__(self) -> None:
        self.jobs: dict[str, dict[str, Any]] = {}
        self.handed_back: list[str] = []

    def add(
        self, job_id: str, request: dict[str, Any], kind: str = "chat", *, request_id: str | None = None
    ) -> None:
        self.jobs[job_id] = {
            "status": "queued",
            "epoch": 0,
            "attempts": 0,
            "request": request,
            "kind": kind,
            "request_id": request_id,
        }

    def undispatch(self, job_ids: list[str]) -> None:
        """Batch lines given back to the feeder, unclaimed."""
        self.handed_back.extend(j for j in job_ids if self.jobs[j]["status"] == "queued")

    def claim_many(
        self,
        job_ids: list[str],
        owner: str,
        lease_seconds: float,
        max_attempts: int,
        *,
        max_request_bytes: int = 2**62,
    ) -> list[Claim]:
        claims = []
        for job_id in job_ids:
            job = self.jobs.get(job_id)
            if job is None or job["status"] != "queued" or job["attempts"] >= max_attempts:
                continue
            job.update(status="running", epoch=job["epoch"] + 1, attempts=job["attempts"] + 1, owner=owner)
            size = len(json.dumps(job["request"]))
            claims.append(
                Claim(
                    job_id,
                    job["epoch"],
                    job["attempts"],
                    job["kind"],
                    "m",
                    0,
                    "t",
                    {} if size > max_request_bytes else job["request"],
                    datetime.now(UTC),
                    None,
                    size,
                    job["request_id"],
                )
            )
        return claims

    def finish_many(self, results: list[Result]) -> set[str]:
        written = set()
        for r in results:
            job = self.jobs[r.job_id]
            if job["epoch"] != r.epoch or job["status"] != "running":
                continue
            job.update(
                status=r.status,
                response=r.response,
                error=r.error,
                usage=r.usage,
                generation_stats=r.generation_stats,
                events=r.events,
                queue_wait_seconds=r.queue_wait_seconds,
                ttft_seconds=r.ttft_seconds,
                e2e_seconds=r.e2e_seconds,
            )
            written.add(r.job_id)
        return written


class FakeStreams:
    """The StreamPublisher contract, in memory: what would have been shipped to Redis."""

    flush_tokens = 4
    flush_seconds = 10.0

    def cadence(self, job_id: str) -> tuple[int, float]:
        return self.flush_tokens, self.flush_seconds

    def merge_seconds(self, job_id: str) -> float:
        return 0.0

    def __init__(self) -> None:
        self.shipped: dict[str, list[dict[str, Any]]] = {}
        self.discarded: list[str] = []

    def open(self, job_id: str, epoch: int, header: dict[str, Any], *, n: int = 1) -> Any:
        from worker.deltas import JobStream

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


class DyingEngine:
    """An engine whose core dies when it is given a request `kills` picks (as a constraint
    that segfaults the structured-output compiler in the engine core would): every request
    in flight then ends with `EngineDead`. Until then it answers like `InstantEngine`, one
    token every `delay` seconds."""

    def __init__(self, kills: Any = lambda spec: False, *, delay: float = 0.01) -> None:
        from worker.engine import InstantEngine

        self._inner = InstantEngine(delay=delay)
        self.kills = kills
        self.dead = False
        self.name, self.version = "dying", "0"

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def generate(self, spec: Any) -> Any:
        from worker.engine import EngineDead

        if self.dead or self.kills(spec):
            self.dead = True
            raise EngineDead("engine core died")
        async for update in self._inner.generate(spec):
            if self.dead:
                raise EngineDead("engine core died")
            yield update


def served(
    *names: str,
    max_model_len: int | None = None,
    vocab_size: int | None = None,
    count: Callable[[Any], int] | None = None,
) -> ModelRegistry:
    """A registry with no live worker serving the declared `names`, each with this context
    length and vocabulary, and prompts counted by `count` (None: no tokenizer reachable)."""
    models = [
        ServedModel(n, declared=True, max_model_len=max_model_len, vocab_size=vocab_size) for n in names
    ]
    return ModelRegistry(lambda: [], declared=models, counters=(lambda m: count) if count else None)


def fake_runner(
    store: Any,
    loop: LoopThread,
    *,
    engine: Engine | None = None,
    renderer: Renderer | None = None,
    streams: Any = None,
    constraints: ConstraintChecker | None = None,
    name: str = "w1",
    fingerprint: str = "fp",
    job_timeout_seconds: float = 30,
    **config: Any,
) -> JobRunner:
    """A JobRunner over a fake (or real) store: an instant engine, the byte renderer and
    in-memory streams unless given, the unit tests' lease, attempts and timeout, and any
    other RunnerConfig field in `config`."""
    return JobRunner(
        store,
        InstantEngine() if engine is None else engine,
        loop,
        ByteRenderer() if renderer is None else renderer,
        ResourceSampler(ProcessTree(self_pid), None),
        FakeStreams() if streams is None else streams,
        RunnerConfig(
            name,
            lease_seconds=30,
            max_attempts=3,
            job_timeout_seconds=job_timeout_seconds,
            system_fingerprint=fingerprint,
            **config,
        ),
        constraints=constraints,
    )
