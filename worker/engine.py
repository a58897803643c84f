"""The engine port: what the runner needs from an inference engine.

`worker/vllm_engine.py` implements it with vLLM's AsyncLLM (the only module that imports
vllm). `InstantEngine` answers at once; it exists for unit tests and the overhead benchmark,
never as a default.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


class EngineDead(Exception):
    """The engine cannot serve any request again; the worker must restart."""


class PromptTooLong(Exception):
    """The prompt does not fit the model's context; the job fails with a 400."""


class RequestRejected(Exception):
    """The engine refused the request's parameters (an out-of-vocabulary token id, ...);
    the job fails with a 400 naming `param`."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class GenerationSpec:
    """One request, translated: token ids in, vLLM `SamplingParams` keyword arguments."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: dict[str, Any]
    priority: int = 0

    @property
    def n(self) -> int:
        return int(self.sampling.get("n", 1))


@dataclass
class TokenLogprob:
    token: str
    logprob: float
    token_bytes: list[int] | None
    top: list[tuple[str, float, list[int] | None]] = field(default_factory=list)


@dataclass
class PromptLogprob:
    """One prompt token: its text, its logprob (None for the first) and alternatives."""

    token: str
    logprob: float | None
    top: list[tuple[str, float]] = field(default_factory=list)


@dataclass
class ChoiceDelta:
    """New output of one choice since the previous update."""

    index: int
    text: str
    token_ids: Sequence[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort"
    stop_reason: int | str | None = None


@dataclass
class EngineUpdate:
    deltas: list[ChoiceDelta]
    prompt_tokens: int
    cached_tokens: int
    finished: bool
    # Per prompt token, when `prompt_logprobs` was asked for (the first update only); the
    # first token has no logprob (nothing precedes it): its entry's logprob is None.
    prompt_logprobs: list[PromptLogprob] | None = None


class Engine(Protocol):
    """An engine that batches every in-flight request it is given."""

    name: str
    version: str
    # Whether a request's updates merge while its consumer is away (vLLM's DELTA outputs
    # do): a consumer may then take them less often without slowing the request.
    merges_updates: bool

    async def start(self) -> None: ...

    def generate(self, spec: GenerationSpec) -> AsyncIterator[EngineUpdate]: ...

    async def abort(self, request_id: str) -> None: ...

    def hasten(self, request_id: str) -> None:
        """A client streams this request now: from its next steps on, its updates come as
        they are made, not `stream_interval` tokens apart (`sampling_kwargs`'s quiet
        interval). Called on the engine's loop; a request not (yet) running is no error."""
        ...

    async def close(self) -> None: ...

    def process_ids(self) -> list[int]:
        """Pids whose memory counts as the engine's (engine core processes)."""
        ...

    def max_model_len(self) -> int: ...

    def extract_tool_calls(
        self, text: str, request: dict[str, Any]
    ) -> tuple[str | None, list[dict[str, Any]]] | None:
        """The configured tool-call parser's reading of `text` (content, calls), or None."""
        ...


class ByteRenderer:
    """Prompt ids for `InstantEngine`: the UTF-8 bytes of the messages' text."""

    def render(self, req: Any, plan: Any = None) -> list[int]:
        from app.domain.prompts import message_text

        text = "\n".join(message_text(getattr(m, "content", None)) or "" for m in req.messages)
        return list(text.encode("utf-8"))

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: list[int]) -> str:
        return bytes(t % 256 for t in token_ids).decode("utf-8", "replace")


class InstantEngine:
    """Answers every request at once with deterministic text; for tests and overhead
    benchmarks only. Each output token is the word `tok` plus its position; `delay`
    seconds per token make jobs take time."""

    name = "instant"
    version = "0"
    merges_updates = False  # each token waits for its consumer

    def __init__(self, *, context: int = 4096, delay: float = 0.0) -> None:
        self._context = context
        self._delay = delay
        self._aborted: set[str] = set()
        self.started = False

    async def start(self) -> None:
        self.started = True

    async def generate(self, spec: GenerationSpec) -> AsyncIterator[EngineUpdate]:
        if len(spec.prompt_token_ids) >= self._context:
            raise PromptTooLong(
                f"prompt is {len(spec.prompt_token_ids)} tokens; the context is {self._context}"
            )
        limit = int(spec.sampling.get("max_tokens") or 16)
        prompt = len(spec.prompt_token_ids)
        for step in range(limit):
            if self._delay:
                await asyncio.sleep(self._delay)
            if spec.request_id in self._aborted:
                self._aborted.discard(spec.request_id)
                yield EngineUpdate(
                    [ChoiceDelta(i, "", [], finish_reason="abort") for i in range(spec.n)],
                    prompt,
                    0,
                    True,
                )
                return
            last = step == limit - 1
            asked = spec.sampling.get("prompt_logprobs")
            prompt_logprobs = (
                [
                    PromptLogprob(chr(t % 256), None if i == 0 else -1.0)
                    for i, t in enumerate(spec.prompt_token_ids)
                ]
                if asked is not None and step == 0
                else None
            )
            yield EngineUpdate(
                [
                    ChoiceDelta(
                        i,
                        f" tok{step}" if step else f"tok{step}",
                        [step],
                        finish_reason="length" if last else None,
                    )
                    for i in range(spec.n)
                ],
                prompt,
                0,
                last,
                prompt_logprobs,
            )

    async def abort(self, request_id: str) -> None:
        self._aborted.add(request_id)

    def hasten(self, request_id: str) -> None:
        """Every token is an update here already."""

    async def close(self) -> None:
        self.started = False

    def process_ids(self) -> list[int]:
        return []

    def max_model_len(self) -> int:
        return self._context

    def extract_tool_calls(
        self, text: str, request: dict[str, Any]
    ) -> tuple[str | None, list[dict[str, Any]]] | None:
        return None
