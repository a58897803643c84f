"""Jobs, start to end: claim → translate → generate (streaming chunks) → save, fenced by
epoch. A single job and a chunk of batch lines take the same path; a chunk is claimed with
one statement, runs concurrently in the engine, and is saved with one statement. End events
are published only after Postgres accepted the results."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError, SQLAlchemyError

from app import tracing
from app.completions import CompletionDict, UsageDict, chunk_header
from app.completions import usage as completion_usage
from app.domain.status import JobKind, JobStatus
from app.domain.tools import call_id
from app.errors import InvalidRequest, LlmqError, error_body
from app.schemas.chat import ChatCompletionV2Request
from app.services.contract import ConstraintChecker
from app.text_completions import prompt_entries, text_completion_id
from worker.deltas import JobStream, StreamShape
from worker.engine import Engine, EngineDead, EngineUpdate, PromptTooLong, RequestRejected
from worker.gather import Gather
from worker.loop import LoopThread
from worker.metrics import JobFigures
from worker.response import ChoiceState, build_completion, finalize
from worker.slots import JobSlots
from worker.stats import ResourceSampler, generation_stats, power_usage
from worker.store import Claim, JobStore, Result
from worker.streaming import StreamPublisher
from worker.text_completion import build_text_completion, text_choices
from worker.translate import Renderer, Translation, translate

log = logging.getLogger("llmq.runner")

T = TypeVar("T")

# How long a line that ended waits for others of its chunk ending with it, to share one write.
SAVE_TOGETHER_SECONDS = 0.02


@dataclass
class Inflight:
    """A job in the engine, and why it may be stopped early. The flags are set by other
    threads and read once the engine is done with the job (plain bools: set once, read later)."""

    job_id: str
    epoch: int
    request_id: str
    cancelled: bool = False
    lost: bool = False
    released: bool = False
    # While the runner leaves the engine's updates merging (nobody watches): the future
    # its wait ends on, set early by `hasten`. Only touched on the engine's loop.
    nap: asyncio.Future[None] | None = None


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
    # Jobs in the engine at once, however the task threads' messages divide them (None: no
    # bound, for tests only).
    max_inflight: int | None = None
    # Requests larger than this (bytes of stored JSON) fail before they are parsed or rendered.
    max_request_bytes: int = 2 * 1024 * 1024
    # How long a chunk of batch lines waits for a free job slot before it goes back to the
    # feeder whole. A full worker still takes messages (its broker prefetch counts messages,
    # not lines), and a chunk waiting in it is out of every other worker's reach; its engine
    # meanwhile has its own waiting lines, so handing the chunk on costs it nothing.
    chunk_slot_wait_seconds: float = 2.0
    # Tokens per engine update for a job not submitted with `stream: true` (1: every token),
    # until somebody streams it (`hasten`). See worker/translate.py's `sampling_kwargs`.
    quiet_stream_interval: int = 1
    # Told of each job this worker ended, once its end is stored (worker/metrics.py).
    observe: Callable[[JobFigures], None] | None = None


class Outcome:
    """What the engine produced for one job, as it arrived."""

    def __init__(self, n: int) -> None:
        self.choices = [ChoiceState(i) for i in range(n)]
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.submitted = time.monotonic()
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.error: BaseException | None = None
        # An echoed prompt's tokens and logprobs (text completions with `echo` and `logprobs`).
        self.prompt_logprobs: list[dict[str, Any]] | None = None

    def add(self, update: EngineUpdate) -> None:
        now = time.monotonic()
        if update.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = prompt_entries(update.prompt_logprobs)
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

    def merge_pause(self, pause: float, max_tokens: int | None) -> float:
        """`pause`, cut to most of the time the job has left before its furthest choice
        reaches `max_tokens` at its pace so far: a job that runs to its limit is taken as it
        ends, not up to `pause` later (one that stops sooner, at a stop token, may be)."""
        made = max(c.tokens for c in self.choices)
        if max_tokens is None or self.first_token is None or self.last_token is None or made < 2:
            return pause
        per_token = (self.last_token - self.first_token) / (made - 1)
        return min(pause, 0.8 * per_token * max(max_tokens - made, 0))


def stream_shape(tr: Translation, job_id: str) -> StreamShape:
    mode = {"named": "arguments", "required": "buffered", "auto": "buffered"}.get(tr.tools.mode, "content")
    return StreamShape(
        mode=mode,
        tool_name=tr.tools.name,
        tool_call_id=call_id(job_id, 0, 0) if mode == "arguments" else None,
        legacy=tr.tools.legacy,
        echo=tr.echo,
        logprobs=tr.logprobs,
        text=tr.text,
    )


@dataclass
class Run:
    """One attempt at one job: what the claim gave, where its events go, what it made."""

    claim: Claim
    stream: JobStream
    ctx: dict[str, Any]
    tr: Translation | None = None
    item: Inflight | None = None
    outcome: Outcome | None = None
    result: Result | None = None
    handed_back: bool = False
    constraint_key: str | None = None  # set when the job has a structured-output constraint
    span: tracing.Span | None = None  # the job's time in the engine, when traced
    claimed: float = 0.0  # time.monotonic() when the claim returned


# Runs handed back from the loop as they end, each with what escaped it (see _drive_all).
EndedRuns = queue.SimpleQueue[tuple[Run, BaseException | None]]


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
        constraints: ConstraintChecker | None = None,
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
        self._slots = JobSlots(config.max_inflight) if config.max_inflight else None
        # Untrusted constraints are compiled in a sandbox before the engine sees them.
        self._constraints = constraints
        # Constraints that have produced a token in this engine: not suspects when it dies.
        self._proven: set[str] = set()
        self.engine_dead = threading.Event()
        # Set when the worker starts to drain: from then on nothing new is claimed, not even
        # by a task thread that was waiting for a slot the drain's aborts free.
        self._draining = threading.Event()
        # The claims and result writes that task threads make at once go together, one
        # statement each (worker/gather.py); a batch chunk's lines already do.
        self._claims: Gather[str, list[Claim]] = Gather(self._claim_many, key=lambda job_id: job_id)
        self._finishes: Gather[Result, set[str]] = Gather(store.finish_many, key=lambda r: r.job_id)

    # --- control from other threads -------------------------------------------------

    def inflight(self) -> list[Inflight]:
        with self._lock:
            return list(self._inflight.values())

    def _abort(self, job_id: str, flag: str) -> bool:
        with self._lock:
            item = self._inflight.get(job_id)
        if item is None:
            return False
        setattr(item, flag, True)
        self._loop.submit(self._engine.abort(item.request_id))
        return True

    def cancel(self, job_id: str) -> bool:
        """Abort `job_id` in the engine if it runs here; its partial text is kept."""
        return self._abort(job_id, "cancelled")

    def lose(self, job_id: str) -> None:
        """Another worker owns the job now (our lease lapsed, or its batch ended): stop."""
        self._abort(job_id, "lost")

    def hasten(self, job_id: str) -> None:
        """Somebody streams `job_id` now: its engine updates come as they are made, not
        `quiet_stream_interval` tokens apart (the stream publisher's `on_heard`)."""
        with self._lock:
            item = self._inflight.get(job_id)
        if item is not None:
            self._loop.loop.call_soon_threadsafe(self._hasten, item)

    def _hasten(self, item: Inflight) -> None:
        """On the loop: the engine's updates as they come, and the runner's wait for them
        cut short, so the new subscriber's first live event is a step away, not a merge."""
        self._engine.hasten(item.request_id)
        if item.nap is not None and not item.nap.done():
            item.nap.set_result(None)

    def release_all(self, grace_seconds: float) -> int:
        """Wait up to `grace_seconds` for running jobs to finish, then abort the rest and
        hand them back to the queue. Nothing is claimed from the call on. Returns how many
        were handed back."""
        self._draining.set()
        deadline = time.monotonic() + grace_seconds
        while self.inflight() and time.monotonic() < deadline:
            time.sleep(0.1)
        items = self.inflight()
        for item in items:
            self._abort(item.job_id, "released")
        return len(items)

    # --- jobs -------------------------------------------------------------------------

    def run(self, job_id: str) -> str | None:
        """Run one job; the status it ended in, or None when the claim was refused
        (someone else has it, or it is over) or the result was fenced out."""
        return self.run_many([job_id]).get(job_id)

    def run_many(self, job_ids: list[str], *, batch: bool = False) -> dict[str, str | None]:
        """Run the jobs among `job_ids` that can be claimed, all at once in the engine. When
        this worker has fewer free job slots than `job_ids` (a chunk of batch lines), it
        runs as many as it has room for and hands the rest back to the batch feeder at once,
        unclaimed: jobs in the engine never exceed the worker's capacity. A `batch` chunk
        that finds no slot free within `chunk_slot_wait_seconds` goes back whole; other
        jobs wait for a slot. Once the worker drains (`release_all`), all go back unclaimed."""
        if self.engine_dead.is_set():
            raise EngineDead("engine is dead; refusing new work")
        wait = self._config.chunk_slot_wait_seconds if batch else None
        held = self._slots.take(len(job_ids), wait) if self._slots is not None else len(job_ids)
        given = 0

        def give(n: int) -> None:
            """A line's slot goes back as soon as its result is stored, not with its chunk's."""
            nonlocal given
            if self._slots is not None:
                self._slots.give(n)
            given += n

        try:
            if self._draining.is_set():
                # Shutting down (it may have waited for this slot since before): the jobs go
                # back unclaimed, to the feeder or the sweeper, for another worker.
                self._persist(lambda: self._store.undispatch(job_ids), {"jobs": len(job_ids)})
                log.info("worker draining; jobs handed back unclaimed", extra={"jobs": len(job_ids)})
                return dict.fromkeys(job_ids)
            if held < len(job_ids):
                rest = job_ids[held:]
                job_ids = job_ids[:held]
                self._persist(lambda: self._store.undispatch(rest), {"jobs": len(rest)})
                log.info("worker full; batch lines handed back to the feeder", extra={"jobs": len(rest)})
            return self._run_claimable(job_ids, give) if job_ids else {}
        finally:
            if self._slots is not None:
                self._slots.give(held - given)

    def _run_claimable(self, job_ids: list[str], give: Callable[[int], None]) -> dict[str, str | None]:
        joined = self._persist(lambda: self._claims(job_ids), {"jobs": len(job_ids)})
        # Other threads' claims may have gone in the same statement: these jobs' are ours.
        ours = {c.job_id: c for c in joined}
        claims = [ours[j] for j in job_ids if j in ours]
        claimed = time.monotonic()
        quiet = len(job_ids) > 1
        if len(claims) < len(job_ids):
            log.info("jobs not claimable; skipped", extra={"count": len(job_ids) - len(claims)})
        # In flight from the claim on, so the lease keeper renews a lease while its prompt
        # renders: a slow render is never taken over and rendered twice at once.
        items = {c.job_id: Inflight(c.job_id, c.epoch, f"{c.job_id}-{c.epoch}") for c in claims}
        with self._lock:
            self._inflight.update(items)
        ready: list[Run] = []
        statuses: dict[str, str | None] = {}
        try:
            runs = [self._prepare(claim, quiet, items[claim.job_id], claimed) for claim in claims]
            ready = [r for r in runs if r.tr is not None]
            for r in ready:
                # Started on this (the task's) thread, so it continues the task's trace.
                r.span = tracing.start_span(
                    tracing.ENGINE_SPAN,
                    {
                        "llmq.job_id": r.claim.job_id,
                        "llmq.epoch": r.claim.epoch,
                        "llmq.batch_id": r.claim.batch_id,
                        "llmq.request_id": r.claim.request_id,
                        "llmq.model": r.claim.model,
                    },
                )
            statuses.update(self._end([r for r in runs if r.tr is None], give))
            # Each line is stored as it ends (lines ending together share one write), so a
            # short line never waits for the longest of its chunk, nor holds its slot. One
            # coroutine drives the chunk's runs on the loop and hands each back as it ends:
            # one hand-over between threads a chunk, not a future (and its waiters) a line.
            ended_runs: EndedRuns = queue.SimpleQueue()
            driver = self._loop.submit(self._drive_all(ready, ended_runs)) if ready else None
            left = len(ready)
            while left:
                ended = [ended_runs.get()]
                deadline = time.monotonic() + SAVE_TOGETHER_SECONDS
                while len(ended) < left and (wait := deadline - time.monotonic()) > 0:
                    try:
                        ended.append(ended_runs.get(timeout=wait))
                    except queue.Empty:
                        break
                left -= len(ended)
                for r, error in ended:
                    if error is not None:
                        raise error
                    self._conclude(r)
                statuses.update(self._end([r for r, _ in ended], give))
            if driver is not None:
                driver.result()  # every run has ended: it is done, or a moment from it
        finally:
            with self._lock:
                for job_id in items:
                    self._inflight.pop(job_id, None)
        if any(isinstance(r.outcome and r.outcome.error, EngineDead) for r in ready):
            self.engine_dead.set()
            raise EngineDead("the engine died while running jobs; they were handed back")
        if quiet:
            log.info("chunk done", extra={"jobs": len(job_ids), "claimed": len(claims), **_count(statuses)})
        return statuses

    def _end(self, runs: list[Run], give: Callable[[int], None]) -> dict[str, str | None]:
        """Out of flight, timed and stored: runs that ended; then their slots go back."""
        if not runs:
            return {}
        with self._lock:
            for r in runs:
                self._inflight.pop(r.claim.job_id, None)
        ended = time.monotonic()
        for r in runs:
            if r.result is not None and not r.handed_back:
                timings(r, ended)
        try:
            return self._save([r for r in runs if r.result is not None])
        finally:
            give(len(runs))

    def _prepare(self, claim: Claim, quiet: bool, item: Inflight, claimed: float) -> Run:
        job_id = claim.job_id
        ctx = {"job_id": job_id, "epoch": claim.epoch, "attempt": claim.attempts, "batch_id": claim.batch_id}
        if claim.request_id is not None:
            ctx["request_id"] = claim.request_id
        log.log(logging.DEBUG if quiet else logging.INFO, "job claimed", extra=ctx)
        header = chunk_header(
            job_id, int(claim.created_at.timestamp()), claim.model, self._config.system_fingerprint
        )
        if claim.kind == JobKind.COMPLETION.value:
            header["id"] = text_completion_id(job_id)
        run = Run(claim, self._streams.open(job_id, claim.epoch, header), ctx, claimed=claimed)
        limit = self._config.max_request_bytes
        if claim.request_bytes > limit:
            # Decided on the size the claim read, before the request is parsed or rendered:
            # the claim did not even load it (see JobStore.claim_many).
            too_large = InvalidRequest(
                f"the request is {claim.request_bytes} bytes; requests over {limit} bytes are not "
                "rendered (LLMQ_MAX_REQUEST_BYTES)",
                code="request_too_large",
            )
            run.result = self._failed(run, too_large.body())
            return run
        try:
            tr = translate(
                claim.request,
                request_id=f"{job_id}-{claim.epoch}",
                kind=claim.kind,
                renderer=self._renderer,
                max_model_len=self._engine.max_model_len(),
                tool_parser=self._config.tool_parser,
                priority=claim.priority,
                quiet_interval=self._config.quiet_stream_interval,
            )
            if tr.constraint is not None:
                # Never compiled here first: a constraint that crashes the compiler is a
                # 400 for this job, not the end of this worker and every job in it.
                run.constraint_key = tr.constraint.key("")
                if self._constraints is not None:
                    self._constraints.check(tr.constraint)
            run.tr = tr
        except LlmqError as exc:
            run.result = self._failed(run, exc.body())
            return run
        run.stream.reshape(stream_shape(run.tr, job_id), run.tr.spec.n)
        run.item = item
        run.outcome = Outcome(run.tr.spec.n)
        return run

    async def _drive_all(self, runs: list[Run], ended: EndedRuns) -> None:
        """Drive `runs` together on the loop, each put in `ended` when it ends (with what
        escaped it: only what is not an Exception, such as a cancellation)."""

        async def one(run: Run) -> None:
            try:
                await self._drive(run)
            except BaseException as exc:
                ended.put((run, exc))
                raise
            ended.put((run, None))

        await asyncio.gather(*(one(r) for r in runs), return_exceptions=True)

    async def _drive(self, run: Run) -> None:
        assert run.tr is not None and run.outcome is not None and run.item is not None
        outcome, stream = run.outcome, run.stream
        if run.item.cancelled or run.item.lost or run.item.released:
            if run.span is not None:
                run.span.end(None)
            return  # stopped while its prompt rendered (an abort then found nothing to stop)

        spec = run.tr.spec
        merges = self._engine.merges_updates
        item = run.item
        loop = asyncio.get_running_loop()

        async def generate() -> None:
            async for update in self._engine.generate(spec):
                outcome.add(update)
                stream.add(update)
                if run.constraint_key is not None and outcome.first_token is not None:
                    self._proven.add(run.constraint_key)
                # Nobody is watching: the engine's next steps wait, merged into one update
                # (worker/streaming.py, quiet_merge_seconds), unless somebody comes to watch
                # meanwhile (`hasten`). What asyncio.sleep does, with the future reachable.
                if merges and not update.finished and (pause := stream.merge_seconds()):
                    item.nap = loop.create_future()
                    timer = loop.call_later(
                        outcome.merge_pause(pause, spec.sampling.get("max_tokens")), _wake, item.nap
                    )
                    try:
                        await item.nap
                    finally:
                        timer.cancel()
                        item.nap = None

        try:
            # In this task (wait_for would run it in a task of its own): one timer, no task.
            async with asyncio.timeout(self._config.job_timeout_seconds):
                await generate()
        except TimeoutError as exc:
            await self._engine.abort(run.tr.spec.request_id)
            outcome.error = exc
        except Exception as exc:  # noqa: BLE001 - kept per job, judged in _conclude
            outcome.error = exc
        finally:
            if run.span is not None:
                run.span.end(outcome.error)

    def _conclude(self, run: Run) -> None:
        """Turn what happened to one run into the result to write (or none)."""
        assert run.item is not None and run.outcome is not None
        error = run.outcome.error
        if isinstance(error, EngineDead) and self._suspect(run):
            # A constraint the engine never ran before may be what killed it: fail it alone,
            # at once, rather than retry it into every other tenant's jobs.
            assert run.tr is not None and run.tr.constraint is not None
            log.warning("engine died with an untried constraint in flight; failing it", extra=run.ctx)
            message = (
                "the engine died while this job's output constraint, never run in it before, was in "
                "flight; it is not retried, as it may be what killed the engine"
            )
            body = InvalidRequest(message, param=run.tr.constraint.param, code="constraint_suspected").body()
            run.result = self._failed(run, body)
        elif (isinstance(error, EngineDead) or run.item.released) and (
            run.claim.attempts >= self._config.max_attempts
        ):
            # Handed back now it could never be claimed again (its attempts are spent): it
            # would sit queued for ever. It ends here, with the reason.
            why = "its engine died" if isinstance(error, EngineDead) else "its worker shut down"
            message = f"the job was stopped {run.claim.attempts} times ({why} the last time); not retried"
            run.result = self._failed(run, error_body(message, "engine_error", code="attempts_exhausted"))
        elif isinstance(error, EngineDead) or run.item.released:
            run.handed_back = True
            run.result = Result(run.claim.job_id, run.claim.epoch, JobStatus.QUEUED.value)
        elif run.item.lost:
            log.info("job taken over or ended elsewhere; result discarded", extra=run.ctx)
            self._streams.discard(run.claim.job_id)
        elif isinstance(error, TimeoutError):
            limit = self._config.job_timeout_seconds
            run.result = self._failed(
                run, error_body(f"the job ran past its deadline of {limit:.0f} s", "timeout", code="timeout")
            )
        elif isinstance(error, PromptTooLong):
            param = "prompt" if run.claim.kind == JobKind.COMPLETION.value else "messages"
            body = InvalidRequest(str(error), param=param, code="context_length_exceeded").body()
            run.result = self._failed(run, body)
        elif isinstance(error, RequestRejected):
            run.result = self._failed(run, InvalidRequest(str(error), param=error.param).body())
        elif error is not None:
            log.error("engine error", extra={**run.ctx, "error": f"{type(error).__name__}: {error}"})
            run.result = self._failed(run, error_body(f"engine error: {error}", "engine_error"))
        else:
            run.result = self._succeeded(run)

    def _suspect(self, run: Run) -> bool:
        """The job's constraint had not produced a token in this engine."""
        key = run.constraint_key
        return key is not None and key not in self._proven

    def _succeeded(self, run: Run) -> Result:
        claim, tr, outcome, item = run.claim, run.tr, run.outcome, run.item
        assert tr is not None and outcome is not None and item is not None
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
        usage = completion_usage(outcome.prompt_tokens, outcome.completion_tokens, outcome.cached_tokens)
        response: Any
        if tr.text:
            response = build_text_completion(
                claim.job_id,
                int(claim.created_at.timestamp()),
                claim.model,
                text_choices(
                    outcome.choices,
                    echo=tr.echo,
                    logprobs=tr.logprobs,
                    prompt_logprobs=outcome.prompt_logprobs,
                ),
                usage,
                system_fingerprint=self._config.system_fingerprint,
            )
        else:
            response = self._chat_response(run, usage)
        cancelled = item.cancelled or any(c.finish_reason == "abort" for c in outcome.choices)
        status = JobStatus.CANCELLED if cancelled else JobStatus.SUCCEEDED
        end = run.stream.end_event(status.value, usage=usage, error=None)
        return Result(
            claim.job_id,
            claim.epoch,
            status.value,
            # The row holds plain JSON objects; the TypedDicts only shaped the building.
            response=cast(dict[str, Any], response),
            usage=cast(dict[str, Any], usage),
            generation_stats=stats,
            power_usage=None if cancelled else power_usage(samples, ended - outcome.submitted),
            events=run.stream.events,
            end=end,
            completion_tokens=outcome.completion_tokens,
        )

    def _chat_response(self, run: Run, usage: UsageDict) -> CompletionDict:
        claim, tr, outcome = run.claim, run.tr, run.outcome
        assert tr is not None and outcome is not None and isinstance(tr.request, ChatCompletionV2Request)
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
        return build_completion(
            claim,
            finals,
            usage,
            system_fingerprint=self._config.system_fingerprint,
            service_tier=tr.request.service_tier,
        )

    def _failed(self, run: Run, error: dict[str, Any]) -> Result:
        end = run.stream.end_event(JobStatus.FAILED.value, usage=None, error=error["error"])
        return Result(
            run.claim.job_id,
            run.claim.epoch,
            JobStatus.FAILED.value,
            error=error,
            events=run.stream.events,
            end=end,
        )

    # --- saving ---------------------------------------------------------------------------

    def _save(self, runs: list[Run]) -> dict[str, str | None]:
        """One fenced write for all results; end events for those Postgres accepted."""
        if not runs:
            return {}
        results = [r.result for r in runs if r.result is not None]
        ctx = {"jobs": len(results)}
        try:
            accepted = self._persist(lambda: self._finishes(results), ctx)
        except SQLAlchemyError:
            # One row Postgres would not take must not sink the chunk: write them one by
            # one, and a row that still fails records that its result could not be stored.
            log.exception("results could not be stored together; writing them one by one", extra=ctx)
            accepted = set()
            for run in runs:
                assert run.result is not None
                accepted |= self._save_alone(run)
        statuses: dict[str, str | None] = {}
        for run in runs:
            result = run.result
            assert result is not None
            job_id = run.claim.job_id
            if job_id not in accepted:
                log.info("write refused by the epoch fence; another owner has the job", extra=run.ctx)
                self._streams.discard(job_id)
                statuses[job_id] = None
            elif run.handed_back:
                self._streams.discard(job_id)
                log.warning("job handed back to the queue", extra=run.ctx)
                statuses[job_id] = None
            else:
                assert result.end is not None
                run.stream.publish_end(result.end)
                level = logging.INFO if len(runs) == 1 else logging.DEBUG
                log.log(
                    level,
                    "job %s",
                    result.status,
                    extra={**run.ctx, "completion_tokens": result.completion_tokens},
                )
                statuses[job_id] = result.status
                if self._config.observe is not None:
                    self._config.observe(figures(run, result))
        return statuses

    def _claim_many(self, job_ids: list[str]) -> list[Claim]:
        cfg = self._config
        return self._store.claim_many(
            job_ids,
            cfg.worker_name,
            cfg.lease_seconds,
            cfg.max_attempts,
            max_request_bytes=cfg.max_request_bytes,
        )

    def _save_alone(self, run: Run) -> set[str]:
        result = run.result
        assert result is not None
        try:
            return self._persist(lambda: self._store.finish_many([result]), run.ctx)
        except SQLAlchemyError:
            log.exception("result could not be stored", extra=run.ctx)
            if run.handed_back:
                return set()
            run.result = Result(
                result.job_id,
                result.epoch,
                JobStatus.FAILED.value,
                error=error_body(
                    "the result could not be stored", "internal_error", code="result_not_stored"
                ),
                end=result.end and {**result.end, "status": JobStatus.FAILED.value},
            )
            return self._persist(lambda: self._store.finish_many([run.result]), run.ctx)  # type: ignore[list-item]

    def _persist(self, write: Callable[[], T], ctx: dict[str, Any]) -> T:
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


def _wake(nap: asyncio.Future[None]) -> None:
    if not nap.done():
        nap.set_result(None)


def timings(run: Run, ended: float) -> None:
    """The job's queue wait, time to first token and end-to-end seconds, onto its result
    (stored with it, and observed by worker/metrics.py from there)."""
    result, outcome = run.result, run.outcome
    assert result is not None
    result.queue_wait_seconds = round(run.claim.queue_wait_seconds, 6)
    result.e2e_seconds = round(run.claim.age_seconds + (ended - run.claimed), 6)
    if outcome is not None and outcome.first_token is not None:
        result.ttft_seconds = round(outcome.first_token - outcome.submitted, 6)


def figures(run: Run, result: Result) -> JobFigures:
    outcome = run.outcome
    prompt, completion = (outcome.prompt_tokens, outcome.completion_tokens) if outcome is not None else (0, 0)
    inter_token = None
    first, last = (outcome.first_token, outcome.last_token) if outcome is not None else (None, None)
    if first is not None and last is not None and completion > 1 and last > first:
        inter_token = (last - first) / (completion - 1)
    return JobFigures(
        model=run.claim.model,
        status=result.status,
        queue_wait_seconds=result.queue_wait_seconds,
        ttft_seconds=result.ttft_seconds,
        inter_token_seconds=inter_token,
        e2e_seconds=result.e2e_seconds,
        output_tokens_per_second=1.0 / inter_token if inter_token else None,
        prompt_tokens=prompt,
        completion_tokens=completion,
    )


def _count(statuses: dict[str, str | None]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for status in statuses.values():
        key = status or "discarded"
        counts[key] = counts.get(key, 0) + 1
    return counts
