"""A simulated GPU engine for fleet tests and benchmarks (`LLMQ_ENGINE=simulated`), never a
default: it serves any model name without weights and spends time the way a
continuous-batching engine does, so many workers fit on one small machine.

The model of time, per engine step:

- at most `max_num_seqs` sequences run (a request with `n` choices is `n` sequences); the
  others wait, admitted in (priority, arrival) order as sequences finish, never skipping
  ahead of an earlier request that does not fit yet (vLLM's priority policy, no preemption);
- a step costs `step_ms + step_ms_per_seq × running sequences`, plus
  `prefill_ms_per_token × prompt tokens` of the requests admitted in it;
- every running sequence gets one token per step (the prefill step makes the first).

One scheduler task on the worker's event loop runs every step and sleeps for its cost, so
thousands of sequences cost a timer, not a timer each, and no CPU while the "GPU" works.

Text is deterministic: each choice's tokens are drawn from a small vocabulary by a
generator seeded from the prompt's token ids, the request's `seed` (else the engine's) and
the choice index. `max_tokens`, `stop` strings (held back until they cannot be the start of
a stop), `stop_token_ids`, `min_tokens`, `include_stop_str_in_output`, `logprobs` and
abort behave as in vLLM; an answer never ends on its own (no end-of-sequence token), so
without a stop it runs to `max_tokens`. Structured outputs are refused.
"""

from __future__ import annotations

import asyncio
import hashlib
import heapq
import itertools
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from app.settings import Settings
from worker.engine import (
    ChoiceDelta,
    EngineDead,
    EngineUpdate,
    GenerationSpec,
    PromptTooLong,
    RequestRejected,
    TokenLogprob,
)

# Token id i is VOCABULARY[i].
VOCABULARY = (
    "the", "queue", "ran", "every", "line", "in", "order", "and", "engine", "kept", "its",
    "slots", "full", "while", "fleet", "grew", "from", "one", "worker", "to", "eight",
    "without", "losing", "a", "single", "request", "so", "batches", "ended", "on", "time", "well",
)  # fmt: skip


@dataclass(frozen=True)
class StepCost:
    """Milliseconds a step takes: `step_ms + step_ms_per_seq × running +
    prefill_ms_per_token × prompt tokens admitted in the step`."""

    step_ms: float = 8.0
    step_ms_per_seq: float = 0.08
    prefill_ms_per_token: float = 0.05

    def seconds(self, running: int, prefill_tokens: int) -> float:
        ms = self.step_ms + self.step_ms_per_seq * running + self.prefill_ms_per_token * prefill_tokens
        return ms / 1000.0


class Clock:
    """Time as the scheduler sees it: the loop's clock and `asyncio.sleep`. Tests pass a
    fake one that jumps instead of waiting."""

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


@dataclass
class _Choice:
    index: int
    rng: random.Random
    text: str = ""
    sent: int = 0  # characters of `text` already sent
    tokens: int = 0
    finish: str | None = None
    stop_reason: int | str | None = None


@dataclass
class _Request:
    spec: GenerationSpec
    order: int
    choices: list[_Choice]
    max_tokens: int
    stops: list[str]
    stop_ids: set[int]
    min_tokens: int
    include_stop: bool
    logprobs: int | None
    updates: asyncio.Queue[EngineUpdate | BaseException] = field(default_factory=asyncio.Queue)
    state: str = "waiting"  # waiting → running → done

    @property
    def live(self) -> list[_Choice]:
        return [c for c in self.choices if c.finish is None]

    def key(self) -> tuple[int, int]:
        return (self.spec.priority, self.order)


def _seeded(prompt: list[int], seed: int, index: int) -> random.Random:
    digest = hashlib.blake2b(repr((seed, index)).encode(), digest_size=8)
    digest.update(bytes(b & 0xFF for b in prompt[:4096]))
    digest.update(len(prompt).to_bytes(8, "little"))
    return random.Random(int.from_bytes(digest.digest(), "little"))  # noqa: S311 - not secret


class SimulatedEngine:
    name = "simulated"
    version = "1"
    merges_updates = False

    def __init__(
        self,
        *,
        max_num_seqs: int,
        context: int = 4096,
        cost: StepCost | None = None,
        seed: int = 0,
        clock: Clock | None = None,
    ) -> None:
        self._max_seqs = max_num_seqs
        self._context = context
        self._cost = cost or StepCost()
        self._seed = seed
        self._clock = clock or Clock()
        self._waiting: list[tuple[tuple[int, int], _Request]] = []
        self._running: list[_Request] = []
        self._requests: dict[str, _Request] = {}
        self._order = itertools.count()
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._dead: BaseException | None = None
        self.steps = 0  # steps run so far (for tests and benchmarks)

    # --- what the scheduler holds ---------------------------------------------------

    @property
    def running_seqs(self) -> int:
        return sum(len(r.live) for r in self._running)

    @property
    def waiting_requests(self) -> int:
        return sum(1 for _, r in self._waiting if r.state == "waiting")

    # --- the Engine port ------------------------------------------------------------

    async def start(self) -> None:
        self._ensure_scheduler()

    async def generate(self, spec: GenerationSpec) -> AsyncIterator[EngineUpdate]:
        request = self._accept(spec)
        self._ensure_scheduler()
        heapq.heappush(self._waiting, (request.key(), request))
        self._requests[spec.request_id] = request
        assert self._wake is not None
        self._wake.set()
        try:
            while True:
                item = await request.updates.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            # The consumer went away (a timeout, a cancelled task): free its sequences.
            if request.state != "done":
                self._end(request)

    async def abort(self, request_id: str) -> None:
        request = self._requests.get(request_id)
        if request is None or request.state == "done":
            return
        deltas = [ChoiceDelta(c.index, "", [], finish_reason="abort") for c in request.live]
        self._end(request)
        request.updates.put_nowait(EngineUpdate(deltas, len(request.spec.prompt_token_ids), 0, True))

    def hasten(self, request_id: str) -> None:
        """Every step is an update here already."""

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        for request in list(self._requests.values()):
            await self.abort(request.spec.request_id)

    def process_ids(self) -> list[int]:
        return []

    def max_model_len(self) -> int:
        return self._context

    def extract_tool_calls(
        self, text: str, request: dict[str, Any]
    ) -> tuple[str | None, list[dict[str, Any]]] | None:
        return None

    # --- admission ------------------------------------------------------------------

    def _accept(self, spec: GenerationSpec) -> _Request:
        """The request's parameters, checked. Raises PromptTooLong, RequestRejected or
        EngineDead (the scheduler failed)."""
        if self._dead is not None:
            raise EngineDead(f"the simulated engine's scheduler failed: {self._dead}")
        prompt = spec.prompt_token_ids
        if len(prompt) >= self._context:
            raise PromptTooLong(f"prompt is {len(prompt)} tokens; the context is {self._context}")
        sampling = spec.sampling
        if sampling.get("structured_outputs") is not None:
            raise RequestRejected("the simulated engine does not run structured outputs", "response_format")
        if spec.n > self._max_seqs:
            raise RequestRejected(f"n is {spec.n}; this engine runs {self._max_seqs} sequences", "n")
        seed = sampling.get("seed")
        seed = self._seed if seed is None else int(seed)
        logprobs = sampling.get("logprobs")
        return _Request(
            spec=spec,
            order=next(self._order),
            choices=[_Choice(i, _seeded(prompt, seed, i)) for i in range(spec.n)],
            max_tokens=max(1, min(int(sampling.get("max_tokens") or 16), self._context - len(prompt))),
            stops=[s for s in sampling.get("stop") or [] if s],
            stop_ids=set(sampling.get("stop_token_ids") or []),
            min_tokens=int(sampling.get("min_tokens") or 0),
            include_stop=bool(sampling.get("include_stop_str_in_output")),
            logprobs=None if logprobs is None else int(logprobs),
        )

    def _admit(self) -> int:
        """Move waiting requests into the running set while their sequences fit, in order.
        Returns the prompt tokens to prefill."""
        prefill = 0
        running = self.running_seqs
        while self._waiting:
            _, head = self._waiting[0]
            if head.state != "waiting":
                heapq.heappop(self._waiting)  # aborted while it waited
                continue
            if running + len(head.choices) > self._max_seqs:
                break
            heapq.heappop(self._waiting)
            head.state = "running"
            self._running.append(head)
            running += len(head.choices)
            prefill += len(head.spec.prompt_token_ids)
        return prefill

    def _end(self, request: _Request) -> None:
        if request.state == "running":
            self._running.remove(request)
        request.state = "done"  # a waiting one is dropped from the heap when it reaches the top
        self._requests.pop(request.spec.request_id, None)

    # --- the scheduler --------------------------------------------------------------

    def _ensure_scheduler(self) -> None:
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._schedule(), name="llmq-sim-engine")

    async def _schedule(self) -> None:
        assert self._wake is not None
        last_end: float | None = None  # when the previous step ended, while busy
        try:
            while True:
                prefill = self._admit()
                if not self._running:
                    last_end = None
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                cost = self._cost.seconds(self.running_seqs, prefill)
                now = self._clock.now()
                # The "GPU" works for `cost`, back to back with the previous step, and the
                # tokens appear at its end: the time this process spent handing out the
                # previous step's tokens overlaps this one (up to one step of it), so the
                # simulated speed does not depend on how busy this machine's CPUs are.
                started = now if last_end is None else max(last_end, now - cost)
                last_end = started + cost
                await self._clock.sleep(max(0.0, last_end - now))
                self.steps += 1
                for request in list(self._running):
                    self._step(request)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - every waiter learns the engine is gone
            self._dead = exc
            for request in list(self._requests.values()):
                self._end(request)
                request.updates.put_nowait(EngineDead(f"the simulated engine's scheduler failed: {exc}"))

    def _step(self, request: _Request) -> None:
        """One token for each live choice of a running request."""
        deltas = [self._token(request, choice) for choice in request.live]
        done = not request.live
        if done:
            self._end(request)
        request.updates.put_nowait(EngineUpdate(deltas, len(request.spec.prompt_token_ids), 0, done))

    def _token(self, request: _Request, choice: _Choice) -> ChoiceDelta:
        token_id = choice.rng.randrange(len(VOCABULARY))
        word = VOCABULARY[token_id]
        piece = f" {word}" if choice.tokens else word
        choice.tokens += 1
        choice.text += piece
        checking = choice.tokens > request.min_tokens
        end = len(choice.text)
        if checking and token_id in request.stop_ids:
            choice.finish, choice.stop_reason = "stop", token_id
        elif checking and request.stops:
            for stop in request.stops:
                # Only a stop that ends inside the new piece can be new.
                at = choice.text.find(stop, max(0, end - len(piece) - len(stop) + 1))
                if at >= 0:
                    choice.finish, choice.stop_reason = "stop", stop
                    end = at + len(stop) if request.include_stop else at
                    break
        if choice.finish is None and choice.tokens >= request.max_tokens:
            choice.finish = "length"
        if choice.finish is None and request.stops:
            # Hold back what could still be the start of a stop string.
            end = max(choice.sent, end - max(len(s) for s in request.stops) + 1)
        text = choice.text[choice.sent : end]
        choice.sent = max(choice.sent, end)
        if choice.finish is not None:
            choice.text = choice.text[:end]
        return ChoiceDelta(
            choice.index,
            text,
            [token_id],
            logprobs=self._logprobs(request, choice, token_id),
            finish_reason=choice.finish,
            stop_reason=choice.stop_reason,
        )

    def _logprobs(self, request: _Request, choice: _Choice, token_id: int) -> list[TokenLogprob] | None:
        if request.logprobs is None:
            return None
        word = VOCABULARY[token_id]
        token = f" {word}" if choice.tokens > 1 else word
        top: list[tuple[str, float, list[int] | None]] = []
        for k in range(request.logprobs):
            other = VOCABULARY[(token_id + k) % len(VOCABULARY)]
            top.append((other, -0.25 * (k + 1), list(other.encode())))
        return [TokenLogprob(token, -0.25 * (token_id % 4), list(token.encode()), top)]


def simulated_engine(settings: Settings) -> SimulatedEngine:
    """The engine `LLMQ_ENGINE=simulated` builds from `Settings`."""
    return SimulatedEngine(
        max_num_seqs=settings.max_num_seqs,
        context=settings.max_model_len or 4096,
        cost=StepCost(settings.sim_step_ms, settings.sim_step_ms_per_seq, settings.sim_prefill_ms_per_token),
        seed=settings.engine_seed,
    )
