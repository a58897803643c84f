"""One job, start to end: claim → translate → generate (streaming chunks) → save, fenced
by epoch. The end event is published only after Postgres accepted the result."""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError, SQLAlchemyError

from app.errors import InvalidRequest, LlmqError
from app.models import JobStatus
from app.services.tools import call_id
from worker.engine import Engine, EngineDead, EngineUpdate, GenerationSpec, PromptTooLong
from worker.loop import LoopThread
from worker.response import ChoiceState, build_completion, build_usage, completion_id, finalize
from worker.stats import ResourceSampler, generation_stats, power_usage
from worker.store import Claim, JobStore
from worker.streaming import JobStream, StreamPublisher, StreamShape
from worker.translate import Renderer, Translation, translate

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
    tool_parser: str | None = None


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


def stream_shape(tr: Translation, job_id: str) -> StreamShape:
    mode = {"named": "arguments", "required": "buffered", "auto": "buffered"}.get(tr.tools.mode, "content")
    return StreamShape(
        mode=mode,
        tool_name=tr.tools.name,
        tool_call_id=call_id(job_id, 0, 0) if mode == "arguments" else None,
        legacy=tr.tools.legacy,
        echo=tr.echo,
        logprobs=tr.logprobs,
    )


@dataclass
class Run:
    """One attempt at one job: what the claim gave, and where its events go."""

    claim: Claim
    stream: JobStream
    ctx: dict[str, Any]


class JobRunner:
    def __init__(
        self,
        store: JobStore,
        engine: Engine,
        loop: LoopThread,
        renderer: Renderer,
        sampler: ResourceSampler,
        streams: StreamPublisher,
        config: RunnerConfig,
    ) -> None:
        self._store = store
        self._engine = engine
        self._loop = loop
        self._renderer = renderer
        self._sampler = sampler
        self._streams = streams
        self._config = config
        self._inflight: dict[str, Inflight] = {}
        self._lock = threading.Lock()
        self.engine_dead = threading.Event()

    # --- control from other threads -------------------------------------------------

    def inflight(self) -> list[Inflight]:
        with self._lock:
            return list(self._inflight.values())

    def _abort(self, job_id: str, flag: str) -> bool:
        with self._lock:
            item = self._inflight.get(job_id)
        if item is None:
            return False
        getattr(item, flag).set()
        self._loop.submit(self._engine.abort(item.request_id))
        return True

    def cancel(self, job_id: str) -> bool:
        """Abort `job_id` in the engine if it runs here; its partial text is kept."""
        return self._abort(job_id, "cancelled")

    def lose(self, job_id: str) -> None:
        """Another worker owns the job now (our lease lapsed): stop spending on it."""
        self._abort(job_id, "lost")

    def release_all(self, grace_seconds: float) -> int:
        """Wait up to `grace_seconds` for running jobs to finish, then abort the rest and
        hand them back to the queue. Returns how many were handed back."""
        deadline = time.monotonic() + grace_seconds
        while self.inflight() and time.monotonic() < deadline:
            time.sleep(0.1)
        items = self.inflight()
        for item in items:
            self._abort(item.job_id, "released")
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
        request = claim.request
        header = {
            "id": completion_id(job_id),
            "created": int(claim.created_at.timestamp()),
            "model": claim.model,
            "system_fingerprint": cfg.system_fingerprint,
        }
        stream = self._streams.open(job_id, claim.epoch, header)
        run = Run(claim, stream, ctx)
        try:
            tr = translate(
                request,
                request_id=f"{job_id}-{claim.epoch}",
                kind=claim.kind,
                renderer=self._renderer,
                max_model_len=self._engine.max_model_len(),
                tool_parser=cfg.tool_parser,
            )
        except LlmqError as exc:
            return self._end_failed(run, exc.body())
        stream.reshape(stream_shape(tr, job_id), tr.spec.n)
        item = Inflight(job_id, claim.epoch, tr.spec.request_id)
        with self._lock:
            self._inflight[job_id] = item
        try:
            return self._generate_and_save(run, tr, item)
        finally:
            with self._lock:
                self._inflight.pop(job_id, None)

    def _generate_and_save(self, run: Run, tr: Translation, item: Inflight) -> str | None:
        spec = tr.spec
        outcome = Outcome(spec.n)
        future = self._loop.submit(self._drive(spec, outcome, run.stream))
        try:
            future.result(timeout=self._config.job_timeout_seconds)
        except concurrent.futures.TimeoutError:
            self._loop.submit(self._engine.abort(spec.request_id))
            deadline = self._config.job_timeout_seconds
            late = InvalidRequest(f"the job ran past its deadline of {deadline:.0f} s", code="timeout")
            return self._end_failed(run, late.body())
        except PromptTooLong as exc:
            too_long = InvalidRequest(str(exc), param="messages", code="context_length_exceeded")
            return self._end_failed(run, too_long.body())
        except EngineDead:
            self.engine_dead.set()
            self._hand_back(run, "engine died")
            raise
        except Exception as exc:
            log.exception("engine error", extra=run.ctx)
            error = {
                "error": {
                    "message": f"engine error: {exc}",
                    "type": "engine_error",
                    "param": None,
                    "code": None,
                }
            }
            return self._end_failed(run, error)
        if item.lost.is_set():
            log.warning("lease lost while running; result discarded", extra=run.ctx)
            self._streams.discard(run.claim.job_id)
            return None
        if item.released.is_set():
            self._hand_back(run, "worker shutting down")
            return None
        return self._save(run, tr, outcome, item)

    async def _drive(self, spec: GenerationSpec, outcome: Outcome, stream: JobStream) -> None:
        async for update in self._engine.generate(spec):
            outcome.add(update)
            stream.add(update)

    def _hand_back(self, run: Run, why: str) -> None:
        released = self._persist(lambda: self._store.release(run.claim.job_id, run.claim.epoch), run.ctx)
        self._streams.discard(run.claim.job_id)
        log.warning("job handed back to the queue", extra={**run.ctx, "why": why, "released": released})

    def _save(self, run: Run, tr: Translation, outcome: Outcome, item: Inflight) -> str | None:
        claim = run.claim
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
        finals = [
            finalize(
                c,
                job_id=claim.job_id,
                plan=tr.tools,
                echo=tr.echo,
                logprobs=tr.logprobs,
                request=claim.request,
                extract=self._engine.extract_tool_calls if tr.tools.mode == "auto" else None,
            )
            for c in outcome.choices
        ]
        run.stream.complete(finals)
        response = build_completion(
            claim,
            finals,
            usage,
            system_fingerprint=self._config.system_fingerprint,
            service_tier=tr.request.service_tier,
        )
        cancelled = item.cancelled.is_set() or any(c.finish_reason == "abort" for c in outcome.choices)
        status = JobStatus.CANCELLED if cancelled else JobStatus.SUCCEEDED
        end = run.stream.end_event(status.value, usage=usage, error=None)
        events = run.stream.events

        def write() -> bool:
            if cancelled:
                return self._store.cancel(
                    claim.job_id,
                    claim.epoch,
                    response=response,
                    usage=usage,
                    generation_stats=stats,
                    events=events,
                )
            return self._store.succeed(
                claim.job_id,
                claim.epoch,
                response=response,
                usage=usage,
                generation_stats=stats,
                power_usage=power,
                events=events,
            )

        try:
            ok = self._persist(write, run.ctx)
        except SQLAlchemyError as exc:
            log.exception("result could not be stored", extra=run.ctx)
            error = {
                "error": {
                    "message": f"the result could not be stored: {type(exc).__name__}",
                    "type": "internal_error",
                    "param": None,
                    "code": "result_not_stored",
                }
            }
            return self._end_failed(run, error)
        return self._after_write(run, ok, status, end, completion_tokens=outcome.completion_tokens)

    def _end_failed(self, run: Run, error: dict[str, Any]) -> str | None:
        end = run.stream.end_event(JobStatus.FAILED.value, usage=None, error=error["error"])
        events = run.stream.events
        ok = self._persist(
            lambda: self._store.fail(run.claim.job_id, run.claim.epoch, error, events), run.ctx
        )
        return self._after_write(run, ok, JobStatus.FAILED, end, code=error["error"].get("code"))

    def _after_write(
        self, run: Run, ok: bool, status: JobStatus, end: dict[str, Any], **extra: Any
    ) -> str | None:
        if not ok:
            log.warning("write refused by the epoch fence; another worker owns the job", extra=run.ctx)
            self._streams.discard(run.claim.job_id)
            return None
        run.stream.publish_end(end)
        log.info("job %s", status.value, extra={**run.ctx, **extra})
        return status.value

    def _persist(self, write: Callable[[], bool], ctx: dict[str, Any]) -> bool:
        """Run a fenced write, retrying with backoff while the database is unreachable
        (a restart, a failover). Other database errors propagate."""
        delay = 0.5
        deadline = time.monotonic() + self._config.write_retry_seconds
        while True:
            try:
                return write()
            except DBAPIError as exc:
                transient = exc.connection_invalidated or isinstance(exc, OperationalError | InterfaceError)
                if not transient or time.monotonic() > deadline:
                    raise
                log.warning("database unavailable; retrying the write", extra={**ctx, "retry_in": delay})
                time.sleep(delay)
                delay = min(delay * 2, 10.0)
