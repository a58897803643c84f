"""One job, start to end: claim → translate → generate → save, fenced by epoch."""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.exc import DBAPIError, SQLAlchemyError

from app.errors import InvalidRequest, LlmqError
from app.events import JobEvents
from app.models import JobStatus
from worker.engine import Engine, EngineDead, EngineUpdate, GenerationSpec, PromptTooLong
from worker.loop import LoopThread
from worker.response import ChoiceState, build_completion, build_usage
from worker.stats import ResourceSampler, generation_stats, power_usage
from worker.store import Claim, JobStore
from worker.translate import Renderer, translate

log = logging.getLogger("llmq.runner")


@dataclass
class Inflight:
    job_id: str
    epoch: int
    request_id: str
    cancelled: threading.Event = field(default_factory=threading.Event)
    lost: threading.Event = field(default_factory=threading.Event)
    released: threading.Event = field(default_factory=threading.Event)


@dataclass
class RunnerConfig:
    worker_name: str
    lease_seconds: float
    max_attempts: int
    job_timeout_seconds: float
    system_fingerprint: str
    # How long a result write keeps retrying while Postgres is unreachable.
    write_retry_seconds: float = 120.0


class Outcome:
    """What the engine produced for one job, as it arrived."""

    def __init__(self, n: int) -> None:
        self.choices = [ChoiceState(i) for i in range(n)]
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.submitted = time.monotonic()
        self.first_token: float | None = None
        self.last_token: float | None = None

    def add(self, update: EngineUpdate) -> None:
        now = time.monotonic()
        self.prompt_tokens = update.prompt_tokens
        self.cached_tokens = update.cached_tokens
        for delta in update.deltas:
            if delta.token_ids:
                if self.first_token is None:
                    self.first_token = now
                self.last_token = now
            self.choices[delta.index].add(delta)

    @property
    def completion_tokens(self) -> int:
        return sum(c.tokens for c in self.choices)


class JobRunner:
    def __init__(
        self,
        store: JobStore,
        engine: Engine,
        loop: LoopThread,
        renderer: Renderer,
        sampler: ResourceSampler,
        events: JobEvents,
        config: RunnerConfig,
    ) -> None:
        self._store = store
        self._engine = engine
        self._loop = loop
        self._renderer = renderer
        self._sampler = sampler
        self._events = events
        self._config = config
        self._inflight: dict[str, Inflight] = {}
        self._lock = threading.Lock()
        self.engine_dead = threading.Event()

    # --- control from other threads -------------------------------------------------

    def inflight(self) -> list[Inflight]:
        with self._lock:
            return list(self._inflight.values())

    def cancel(self, job_id: str) -> bool:
        """Abort `job_id` in the engine if it runs here. True if it did."""
        with self._lock:
            item = self._inflight.get(job_id)
        if item is None:
            return False
        item.cancelled.set()
        self._loop.submit(self._engine.abort(item.request_id))
        return True

    def lose(self, job_id: str) -> None:
        """Another worker owns the job now (our lease lapsed): stop spending on it."""
        with self._lock:
            item = self._inflight.get(job_id)
        if item is not None:
            item.lost.set()
            self._loop.submit(self._engine.abort(item.request_id))

    def release_all(self, grace_seconds: float) -> int:
        """Wait up to `grace_seconds` for running jobs to finish, then abort the rest and
        hand them back to the queue. Returns how many were handed back."""
        deadline = time.monotonic() + grace_seconds
        while self.inflight() and time.monotonic() < deadline:
            time.sleep(0.1)
        items = self.inflight()
        for item in items:
            item.released.set()
            self._loop.submit(self._engine.abort(item.request_id))
        return len(items)

    # --- the job --------------------------------------------------------------------

    def run(self, job_id: str) -> str | None:
        """Run `job_id` if it can be claimed; returns the status it ended in, or None
        when the claim was refused (someone else has it, or it is over)."""
        if self.engine_dead.is_set():
            raise EngineDead("engine is dead; refusing new work")
        cfg = self._config
        claim = self._store.claim(job_id, cfg.worker_name, cfg.lease_seconds, cfg.max_attempts)
        if claim is None:
            log.info("job not claimable; skipped", extra={"job_id": job_id})
            return None
        ctx = {"job_id": job_id, "epoch": claim.epoch, "attempt": claim.attempts, "batch_id": claim.batch_id}
        log.info("job claimed", extra=ctx)
        try:
            req, spec = translate(
                claim.request,
                request_id=f"{job_id}-{claim.epoch}",
                kind=claim.kind,
                renderer=self._renderer,
                max_model_len=self._engine.max_model_len(),
            )
        except LlmqError as exc:
            return self._end_failed(claim, exc.body(), ctx)
        item = Inflight(job_id, claim.epoch, spec.request_id)
        with self._lock:
            self._inflight[job_id] = item
        try:
            return self._generate_and_save(claim, req.service_tier, spec, item, ctx)
        finally:
            with self._lock:
                self._inflight.pop(job_id, None)

    def _generate_and_save(
        self,
        claim: Claim,
        service_tier: str | None,
        spec: GenerationSpec,
        item: Inflight,
        ctx: dict[str, Any],
    ) -> str | None:
        outcome = Outcome(spec.n)
        future = self._loop.submit(self._drive(spec, outcome))
        try:
            future.result(timeout=self._config.job_timeout_seconds)
        except concurrent.futures.TimeoutError:
            self._loop.submit(self._engine.abort(spec.request_id))
            return self._end_failed(
                claim,
                InvalidRequest(
                    f"the job ran past its deadline of {self._config.job_timeout_seconds:.0f} s",
                    code="timeout",
                ).body(),
                ctx,
            )
        except PromptTooLong as exc:
            return self._end_failed(
                claim, InvalidRequest(str(exc), param="messages", code="context_length_exceeded").body(), ctx
            )
        except EngineDead:
            self.engine_dead.set()
            released = self._persist(lambda: self._store.release(claim.job_id, claim.epoch), ctx)
            log.error("engine died; job released", extra={**ctx, "released": released})
            raise
        except Exception as exc:
            log.exception("engine error", extra=ctx)
            return self._end_failed(
                claim,
                {
                    "error": {
                        "message": f"engine error: {exc}",
                        "type": "engine_error",
                        "param": None,
                        "code": None,
                    }
                },
                ctx,
            )
        if item.lost.is_set():
            log.warning("lease lost while running; result discarded", extra=ctx)
            return None
        if item.released.is_set():
            released = self._persist(lambda: self._store.release(claim.job_id, claim.epoch), ctx)
            log.warning("job handed back to the queue", extra={**ctx, "released": released})
            return None
        return self._save(claim, service_tier, outcome, item, ctx)

    async def _drive(self, spec: GenerationSpec, outcome: Outcome) -> None:
        async for update in self._engine.generate(spec):
            outcome.add(update)

    def _save(
        self, claim: Claim, service_tier: str | None, outcome: Outcome, item: Inflight, ctx: dict[str, Any]
    ) -> str | None:
        ended = time.monotonic()
        samples = self._sampler.window(outcome.submitted, ended)
        stats = generation_stats(
            prompt_tokens=outcome.prompt_tokens,
            completion_tokens=outcome.completion_tokens,
            submitted=outcome.submitted,
            first_token=outcome.first_token,
            last_token=outcome.last_token,
            peak_memory_bytes=max(s.memory_bytes for s in samples),
        )
        power = power_usage(samples, ended - outcome.submitted)
        usage = build_usage(outcome.prompt_tokens, outcome.completion_tokens, outcome.cached_tokens)
        response = build_completion(
            claim,
            outcome.choices,
            usage,
            system_fingerprint=self._config.system_fingerprint,
            service_tier=service_tier,
        )
        if item.cancelled.is_set() or any(c.finish_reason == "abort" for c in outcome.choices):
            status = JobStatus.CANCELLED
            write = lambda: self._store.cancel(  # noqa: E731
                claim.job_id, claim.epoch, response=response, usage=usage, generation_stats=stats
            )
        else:
            status = JobStatus.SUCCEEDED
            write = lambda: self._store.succeed(  # noqa: E731
                claim.job_id,
                claim.epoch,
                response=response,
                usage=usage,
                generation_stats=stats,
                power_usage=power,
            )
        try:
            ok = self._persist(write, ctx)
        except SQLAlchemyError as exc:
            log.exception("result could not be stored", extra=ctx)
            error = {
                "error": {
                    "message": f"the result could not be stored: {type(exc).__name__}",
                    "type": "internal_error",
                    "param": None,
                    "code": "result_not_stored",
                }
            }
            return self._end_failed(claim, error, ctx)
        return self._after_write(claim, ok, status, {**ctx, "completion_tokens": outcome.completion_tokens})

    def _persist(self, write: Callable[[], bool], ctx: dict[str, Any]) -> bool:
        """Run a fenced write, retrying with backoff while the database is unreachable
        (a restart, a failover). Other database errors propagate."""
        delay = 0.5
        deadline = time.monotonic() + self._config.write_retry_seconds
        while True:
            try:
                return write()
            except DBAPIError as exc:
                if not exc.connection_invalidated and not _is_connection_error(exc):
                    raise
                if time.monotonic() > deadline:
                    raise
                log.warning("database unavailable; retrying the write", extra={**ctx, "retry_in": delay})
                time.sleep(delay)
                delay = min(delay * 2, 10.0)

    def _end_failed(self, claim: Claim, error: dict[str, Any], ctx: dict[str, Any]) -> str | None:
        ok = self._persist(lambda: self._store.fail(claim.job_id, claim.epoch, error), ctx)
        return self._after_write(claim, ok, JobStatus.FAILED, {**ctx, "code": error["error"].get("code")})

    def _after_write(self, claim: Claim, ok: bool, status: JobStatus, ctx: dict[str, Any]) -> str | None:
        if not ok:
            log.warning("write refused by the epoch fence; another worker owns the job", extra=ctx)
            return None
        try:
            self._events.publish_end(claim.job_id, status.value)
        except Exception as exc:  # noqa: BLE001 - the result is saved; waiters fall back to Postgres
            log.warning("end notification failed", extra={**ctx, "error": str(exc)})
        log.info("job %s", status.value, extra=ctx)
        return status.value


def _is_connection_error(exc: DBAPIError) -> bool:
    from sqlalchemy.exc import InterfaceError, OperationalError

    return isinstance(exc, OperationalError | InterfaceError)
