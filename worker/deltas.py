"""A job's engine deltas shaped into chunk events: coalesced per choice, content or tool
call arguments as the request asked, handed to an `EventSink` (the Redis transport,
worker/streaming.py) without ever blocking on Redis."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from app.completions import ChunkChoiceDict, ChunkHeader, chunk
from app.events import END_EVENT
from app.text_completions import TextChoiceDict, prompt_entries, text_chunk, text_logprobs
from worker.engine import ChoiceDelta, EngineUpdate
from worker.response import aborted_as, logprob_entry


class EventSink(Protocol):
    """Where a job's events go, and how often its deltas are flushed."""

    def cadence(self, job_id: str) -> tuple[int, float]:
        """(tokens, seconds): flush once either has gathered."""
        ...

    def merge_seconds(self, job_id: str) -> float:
        """How long the engine's updates for the job may wait to be taken, merged (0: take
        each as it comes)."""
        ...

    def submit(self, job_id: str, event: dict[str, Any], *, final: bool = False) -> None: ...


@dataclass
class _Pending:
    """What one choice produced since the last flush."""

    text: list[str] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None
    started: bool = False


@dataclass(frozen=True)
class StreamShape:
    """How a job's deltas read on the wire.

    - `content`: text deltas (`echo` text first);
    - `arguments`: a named tool call whose arguments arrive as they are generated;
    - `buffered`: tool calls found only once the text is complete (`required`, `auto`):
      nothing is sent until the runner calls `JobStream.complete`.
    """

    mode: str = "content"
    tool_name: str | None = None
    tool_call_id: str | None = None
    legacy: bool = False
    echo: str = ""
    logprobs: bool = False
    # A text completion: `text_completion` chunks with `text` and legacy logprobs, no delta.
    text: bool = False


class JobStream:
    """One job's chunk events. Fed on the engine's loop thread; never blocks on Redis."""

    def __init__(
        self,
        publisher: EventSink,
        job_id: str,
        epoch: int,
        header: ChunkHeader,
        *,
        n: int,
        shape: StreamShape | None = None,
    ) -> None:
        self._publisher = publisher
        self.job_id = job_id
        self.epoch = epoch
        self._header = header  # id, created, model, system_fingerprint
        self._pending = [_Pending() for _ in range(n)]
        # Characters each choice has streamed (text completions' logprob `text_offset`).
        self._offsets = [0] * n
        # An echoed prompt's token logprobs, sent ahead of each choice's first tokens.
        self._prompt_logprobs: list[dict[str, Any]] | None = None
        self.shape = shape or StreamShape()
        self._seq = 0
        self._buffered_tokens = 0
        self._last_flush = time.monotonic()
        self.events: list[dict[str, Any]] = []
        self.first_event_at: float | None = None

    def reshape(self, shape: StreamShape, n: int) -> None:
        """Set once the request is translated (before the first token)."""
        self.shape = shape
        self._pending = [_Pending() for _ in range(n)]
        self._offsets = [0] * n

    def _next_id(self) -> str:
        self._seq += 1
        return f"{self.epoch}-{self._seq}"

    def add(self, update: EngineUpdate) -> None:
        if self.shape.mode == "buffered":
            return
        if update.prompt_logprobs is not None and self.shape.text and self.shape.logprobs:
            self._prompt_logprobs = prompt_entries(update.prompt_logprobs)
        finished = False
        for delta in update.deltas:
            self._take(delta)
            if delta.finish_reason:
                finished = True
        if self.first_event_at is None or finished:
            self.flush()  # the first token goes out at once (time to first chunk), and the last
            return
        tokens, seconds = self._publisher.cadence(self.job_id)
        if self._buffered_tokens >= tokens or time.monotonic() - self._last_flush >= seconds:
            self.flush()

    def merge_seconds(self) -> float:
        """How long the runner may leave the engine's next update waiting, its steps merged
        meanwhile (`Engine.merges_updates`): the publisher's answer for this job once it
        has sent its first event, nothing before."""
        return 0.0 if self.first_event_at is None else self._publisher.merge_seconds(self.job_id)

    def _take(self, delta: ChoiceDelta) -> None:
        pending = self._pending[delta.index]
        if delta.text:
            pending.text.append(delta.text)
        if delta.logprobs and self.shape.logprobs:
            pending.logprobs.extend(logprob_entry(lp) for lp in delta.logprobs)
        if delta.finish_reason is not None:
            reason = aborted_as(delta.finish_reason)
            if self.shape.mode == "arguments" and reason == "stop":
                reason = "function_call" if self.shape.legacy else "tool_calls"
            pending.finish_reason = reason
        self._buffered_tokens += len(delta.token_ids)

    def _delta(self, pending: _Pending) -> dict[str, Any]:
        text = "".join(pending.text)
        first = not pending.started
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if self.shape.mode == "arguments":
            if self.shape.legacy:
                call: dict[str, Any] = {"arguments": text}
                if first:
                    call = {"name": self.shape.tool_name, **call}
                delta["function_call"] = call
            else:
                tool: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
                if first:
                    tool = {
                        "index": 0,
                        "id": self.shape.tool_call_id,
                        "type": "function",
                        "function": {"name": self.shape.tool_name, "arguments": text},
                    }
                delta["tool_calls"] = [tool]
        else:
            delta["content"] = (self.shape.echo if first else "") + text
        return delta

    def flush(self) -> None:
        """Turn buffered deltas into one chunk event (if there is anything to say)."""
        if self.shape.text:
            self._flush_text()
            return
        choices: list[ChunkChoiceDict] = []
        for index, pending in enumerate(self._pending):
            if not pending.text and pending.finish_reason is None:
                continue
            delta = self._delta(pending) if pending.text or not pending.started else {}
            choices.append(
                {
                    "index": index,
                    "delta": delta,
                    "logprobs": {"content": pending.logprobs} if pending.logprobs else None,
                    "finish_reason": pending.finish_reason,
                }
            )
            self._pending[index] = _Pending(started=True)
        self._buffered_tokens = 0
        self._last_flush = time.monotonic()
        if choices:
            self._emit_chunk(choices)

    def _flush_text(self) -> None:
        """A text completion's chunk: each choice that moved, with its new text (the echoed
        prompt first) and its tokens' legacy logprobs, offsets continuing the choice's text."""
        choices: list[TextChoiceDict] = []
        for index, pending in enumerate(self._pending):
            if not pending.text and pending.finish_reason is None:
                continue
            text = (self.shape.echo if not pending.started else "") + "".join(pending.text)
            logprobs = None
            lead = self._prompt_logprobs if not pending.started and self._prompt_logprobs else None
            if self.shape.logprobs and (pending.logprobs or lead):
                if lead is not None:
                    logprobs = text_logprobs(lead + pending.logprobs, self._offsets[index])
                else:
                    start = self._offsets[index] + (len(self.shape.echo) if not pending.started else 0)
                    logprobs = text_logprobs(pending.logprobs, start)
            self._offsets[index] += len(text)
            choices.append(
                {"index": index, "text": text, "logprobs": logprobs, "finish_reason": pending.finish_reason}
            )
            self._pending[index] = _Pending(started=True)
        self._buffered_tokens = 0
        self._last_flush = time.monotonic()
        if choices:
            self._emit({"type": "chunk", "data": text_chunk(self._header, choices)})

    def complete(self, finals: list[Any]) -> None:
        """Buffered mode: send each choice whole, tool calls in OpenAI's streaming form."""
        if self.shape.mode != "buffered":
            return
        choices: list[ChunkChoiceDict] = []
        for final in finals:
            message = final.message
            delta: dict[str, Any] = {"role": "assistant"}
            if message.get("content") is not None:
                delta["content"] = message["content"]
            if message.get("function_call"):
                delta["function_call"] = message["function_call"]
            if message.get("tool_calls"):
                delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
            choices.append(
                {
                    "index": final.index,
                    "delta": delta,
                    "logprobs": {"content": final.logprobs} if final.logprobs else None,
                    "finish_reason": final.finish_reason,
                }
            )
        if choices:
            self._emit_chunk(choices)

    def _emit_chunk(self, choices: list[ChunkChoiceDict]) -> None:
        self._emit({"type": "chunk", "data": chunk(self._header, choices)})

    def end_event(
        self, status: str, *, usage: Mapping[str, Any] | None, error: dict[str, Any] | None
    ) -> dict[str, Any]:
        """The terminal event, with its id; recorded (to persist with the result), but
        shipped only by `publish_end`, after the result is safely in Postgres."""
        if self.shape.mode != "buffered":
            self.flush()
        event = {"id": self._next_id(), "type": END_EVENT, "status": status, "usage": usage, "error": error}
        self.events.append(event)
        return event

    def publish_end(self, event: dict[str, Any]) -> None:
        self._publisher.submit(self.job_id, event, final=True)

    def _emit(self, body: dict[str, Any]) -> None:
        # `t`: when the worker produced it (wall clock), for measuring delivery (bench B5).
        event = {"id": self._next_id(), "t": round(time.time(), 4), **body}
        if self.first_event_at is None:
            self.first_event_at = time.monotonic()
        self.events.append(event)
        self._publisher.submit(self.job_id, event)
