"""Chat-template renders that involve user input, in child processes with a time limit.

A Jinja render is CPU-bound and cannot be interrupted in-process. In the API (gunicorn with
gevent workers) one such render would block every greenlet of its process; in the worker it
would hold a task thread past any limit. So a render with user-controlled template input (a
user `chat_template`, the model's template with user `chat_template_kwargs`, or a request too
large to be cheap) goes to a small pool of persistent child processes, each with an
address-space limit; a render that overruns is killed with its child, which is replaced on
next use, and the request gets a 400 naming the field.

The parent talks to a child over pipes with `select.poll` and non-blocking reads and writes,
which gevent patches to cooperate: a greenlet waiting on a render never blocks the others.
The child renders and tokenizes, so the parent gets token ids and does no work per byte.
Messages are length-prefixed JSON; a child whose parent goes away reads EOF and exits.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import select
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.errors import InvalidRequest, ServiceUnavailable

log = logging.getLogger("llmq.templates")

_HEADER = struct.Struct(">I")
_READY = {"ready": True}


class _Overrun(Exception):
    """The child did not answer in time (or died): it is killed."""


@dataclass(frozen=True)
class SandboxJob:
    """One render: `template` None means the model's own template."""

    template: str | None
    messages: list[dict[str, Any]]
    kwargs: dict[str, Any]
    add_special_tokens: bool


class _Child:
    def __init__(self, model: str, memory_bytes: int, start_timeout: float) -> None:
        root = str(Path(__file__).resolve().parents[2])
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
        }
        # One render at a time per child: no tokenizer thread pool to size or fork.
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "app.services.template_sandbox", model, str(memory_bytes)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            close_fds=True,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._out = self.proc.stdin.fileno()
        self._in = self.proc.stdout.fileno()
        os.set_blocking(self._out, False)
        os.set_blocking(self._in, False)
        if self._receive(time.monotonic() + start_timeout) != _READY:
            raise _Overrun("the template sandbox did not start")

    def _wait(self, fd: int, events: int, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise _Overrun("time limit")
        poller = select.poll()
        poller.register(fd, events)
        if not poller.poll(left * 1000):
            raise _Overrun("time limit")

    def _send(self, payload: dict[str, Any], deadline: float) -> None:
        body = json.dumps(payload, separators=(",", ":")).encode("ascii")
        view = memoryview(_HEADER.pack(len(body)) + body)
        while view:
            self._wait(self._out, select.POLLOUT, deadline)
            try:
                view = view[os.write(self._out, view) :]
            except BlockingIOError:
                continue
            except OSError as exc:
                raise _Overrun(f"the sandbox went away: {exc}") from exc

    def _read(self, n: int, deadline: float) -> bytes:
        chunks: list[bytes] = []
        while n:
            self._wait(self._in, select.POLLIN, deadline)
            try:
                chunk = os.read(self._in, min(n, 1 << 20))
            except BlockingIOError:
                continue
            if not chunk:
                raise _Overrun("the sandbox exited")
            chunks.append(chunk)
            n -= len(chunk)
        return b"".join(chunks)

    def _receive(self, deadline: float) -> Any:
        (size,) = _HEADER.unpack(self._read(_HEADER.size, deadline))
        return json.loads(self._read(size, deadline))

    def call(self, payload: dict[str, Any], timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        self._send(payload, deadline)
        return self._receive(deadline)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()


class TemplateSandbox:
    """A pool of `processes` render children, started on first use, replaced when killed."""

    def __init__(
        self,
        model: str,
        *,
        timeout: float,
        max_output: int,
        processes: int = 2,
        memory_bytes: int = 2 * 2**30,
        start_timeout: float = 120.0,
        wait_seconds: float | None = None,
    ) -> None:
        """`wait_seconds`: how long a render may wait for a free child (default 4 × `timeout`;
        the wait costs no CPU) before it is refused as busy."""
        self._model = model
        self._timeout = timeout
        self._max_output = max_output
        self._memory = memory_bytes
        self._start_timeout = start_timeout
        self._wait = wait_seconds if wait_seconds is not None else 4 * timeout
        # Idle slots, the last used first (warm); None: a child not started (or killed).
        self._slots: queue.LifoQueue[_Child | None] = queue.LifoQueue()
        for _ in range(processes):
            self._slots.put(None)

    @property
    def timeout(self) -> float:
        return self._timeout

    def render(self, job: SandboxJob, *, param: str) -> list[int]:
        """Token ids of the rendered prompt.

        Raises:
            InvalidRequest: the template failed, overran its time, or rendered too much
                (`param` names the field the template input came from).
            ServiceUnavailable: every sandbox stayed busy for a while.
        """
        try:
            # Waiting for a free child costs no CPU (greenlets and threads sleep meanwhile).
            child = self._slots.get(timeout=self._wait)
        except queue.Empty as exc:
            raise ServiceUnavailable("every template sandbox is busy; retry later", param=param) from exc
        try:
            if child is None:
                child = _Child(self._model, self._memory, self._start_timeout)
            answer = child.call(
                {
                    "template": job.template,
                    "messages": job.messages,
                    "kwargs": job.kwargs,
                    "add_special_tokens": job.add_special_tokens,
                    "max_output": self._max_output,
                },
                self._timeout,
            )
        except _Overrun as exc:
            if child is not None:
                child.kill()
            child = None
            log.warning("template render killed", extra={"field": param, "why": str(exc)})
            raise InvalidRequest(
                f"the chat template did not finish rendering within {self._timeout:g} s", param=param
            ) from exc
        finally:
            self._slots.put(child)
        if "error" in answer:
            raise InvalidRequest(f"the chat template refused the request: {answer['error']}", param=param)
        return [int(i) for i in answer["ids"]]

    def close(self) -> None:
        while True:
            try:
                child = self._slots.get_nowait()
            except queue.Empty:
                return
            if child is not None:
                child.kill()


# --- the child process -------------------------------------------------------------------


def _render(tokenizer: Any, request: dict[str, Any]) -> dict[str, Any]:
    try:
        kwargs = dict(request["kwargs"])
        if request["template"] is not None:
            kwargs["chat_template"] = request["template"]
        text = str(tokenizer.apply_chat_template(request["messages"], tokenize=False, **kwargs))
        if len(text) > request["max_output"]:
            return {"error": f"the rendered prompt is over {request['max_output']} characters"}
        return {"ids": list(tokenizer.encode(text, add_special_tokens=request["add_special_tokens"]))}
    except Exception as exc:  # noqa: BLE001 - any failure is the request's, reported to it
        return {"error": f"{type(exc).__name__}: {exc}"[:2000]}


def _write(out: Any, payload: dict[str, Any]) -> None:
    body = json.dumps(payload, separators=(",", ":")).encode("ascii")
    out.write(_HEADER.pack(len(body)) + body)
    out.flush()


# How much lower than its parent a sandbox child's CPU priority is (0..19).
SANDBOX_NICENESS = 10


def _read_exactly(n: int) -> bytes | None:
    data = sys.stdin.buffer.read(n)
    return data if len(data) == n else None


def main(argv: list[str]) -> None:
    import resource

    model, memory = argv[0], int(argv[1])
    # The protocol owns the original stdout; anything a library prints goes to stderr.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    # A render that burns its whole time limit takes CPU the requests of other tenants
    # need: it gets what they leave (a nice child yields to the API processes at once).
    os.nice(SANDBOX_NICENESS)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    _write(out, _READY)
    while (header := _read_exactly(_HEADER.size)) is not None:
        body = _read_exactly(_HEADER.unpack(header)[0])
        if body is None:
            return
        _write(out, _render(tokenizer, json.loads(body)))


if __name__ == "__main__":
    main(sys.argv[1:])
