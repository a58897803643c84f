"""Compiles structured-output constraints in sandbox child processes, before anything
reaches an engine.

The structured-output libraries are native code; some inputs make them segfault (a
1,000-step `$ref` chain, 20,000 chained grammar rules) or run without end. Compiled in the
API or the worker, that kills every other tenant's requests with it. Here each compile runs
in a small persistent pool of children (`app/services/constraint_child.py`) with a time
limit and an address-space limit; a child that dies or runs over is replaced, and the
request it was compiling gets a 400 naming its field.

Verdicts are cached by a hash of (backend, constraint) in an LRU per process, so a batch
whose 50,000 lines share one schema compiles it once.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import select
import subprocess
import sys
import time
from pathlib import Path

from app.domain.structured import Constraint, Lru
from app.errors import InvalidRequest
from app.settings import Settings

log = logging.getLogger("llmq.sandbox")

_CRASHED = "compiling it crashed the structured-output compiler"
_ROOT = str(Path(__file__).resolve().parents[2])


class _Child:
    """One sandbox process; used by one caller at a time."""

    def __init__(self, backend: str, memory_bytes: int, start_timeout: float) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([_ROOT, os.environ.get("PYTHONPATH", "")])}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "app.services.constraint_child", backend, str(memory_bytes)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            bufsize=0,
        )
        self._buf = b""
        self.eof = False
        hello = self.read(start_timeout)
        self.unavailable: str | None = None if hello is None else hello.get("unavailable")
        if hello is None or ("ready" not in hello and self.unavailable is None):
            self.kill()
            raise RuntimeError(f"the constraint sandbox for {backend!r} did not start")

    def read(self, timeout: float) -> dict[str, str | None] | None:
        """The next answer line, or None when the child died or ran past `timeout`."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                self.eof = True
                return None
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        answer: dict[str, str | None] = json.loads(line)
        return answer

    def ask(self, payload: bytes, timeout: float) -> dict[str, str | None] | None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(payload)
            self.proc.stdin.flush()
        except OSError:
            return None
        return self.read(timeout)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


class ConstraintSandbox:
    """Checks constraints for one backend in a pool of sandbox processes, with a cache."""

    def __init__(
        self,
        backend: str,
        *,
        processes: int = 2,
        timeout_seconds: float = 5.0,
        memory_bytes: int = 1 << 30,
        cache_size: int = 1024,
        start_timeout_seconds: float = 60.0,
    ) -> None:
        self.backend = backend
        self._timeout = timeout_seconds
        self._memory = memory_bytes
        self._start_timeout = start_timeout_seconds
        self._idle: queue.Queue[_Child | None] = queue.Queue()
        for _ in range(processes):
            self._idle.put(None)  # started on first use
        self._cache: Lru[str, str] = Lru(cache_size)  # "" when it compiled
        self._unavailable: str | None = None
        self.compiles = 0  # verdicts that needed a child (not from the cache)

    @classmethod
    def of(cls, settings: Settings) -> ConstraintSandbox:
        return cls(
            settings.structured_output_backend,
            processes=settings.constraint_sandbox_processes,
            timeout_seconds=settings.constraint_compile_timeout_seconds,
            memory_bytes=settings.constraint_compile_memory_mib << 20,
            cache_size=settings.constraint_cache_size,
        )

    def check(self, found: Constraint) -> None:
        """Raises InvalidRequest (naming `found.param`) when the constraint does not compile,
        crashes the compiler, or runs past its time or memory limit."""
        if "json_object" in found.kwargs:
            return  # a fixed schema: nothing of the user's reaches the compiler
        key = found.key(self.backend)
        verdict = self._cache.get(key)
        if verdict is None:
            verdict = self._compile(found) or ""
            if self._unavailable is not None:
                return
            self._cache.put(key, verdict)
        error = verdict or None
        if error is not None:
            raise InvalidRequest(
                f"`{found.param}` cannot be used as an output constraint: {error}", param=found.param
            )

    def _compile(self, found: Constraint) -> str | None:
        # A child that died is tried once more with a fresh one: it may have been killed
        # for another reason (its parent thread ended) just as this constraint arrived.
        error = self._compile_once(found)
        if error is not None and error.startswith(_CRASHED):
            error = self._compile_once(found)
        return error

    def _compile_once(self, found: Constraint) -> str | None:
        payload = (json.dumps({"kwargs": found.kwargs}, ensure_ascii=True) + "\n").encode()
        child = self._idle.get()
        try:
            if child is None or child.proc.poll() is not None:
                child = _Child(self.backend, self._memory, self._start_timeout)
            if child.unavailable is not None:
                if self._unavailable is None:
                    log.warning(
                        "structured-output library not installed; constraints are not compiled here",
                        extra={"reason": child.unavailable},
                    )
                self._unavailable = child.unavailable
                return None
            self.compiles += 1
            started = time.monotonic()
            answer = child.ask(payload, self._timeout)
            if answer is not None:
                return answer.get("error")
            timed_out = not child.eof
            child.kill()
            rc = child.proc.returncode
            child = None
            log.warning(
                "constraint refused: the compiler %s",
                "ran past its time limit" if timed_out else "died",
                extra={
                    "field": found.param,
                    "returncode": rc,
                    "seconds": round(time.monotonic() - started, 3),
                },
            )
            if timed_out:
                return f"compiling it took longer than {self._timeout:g} s"
            return f"{_CRASHED} (exit {rc})"
        finally:
            self._idle.put(child)

    def close(self) -> None:
        while True:
            try:
                child = self._idle.get_nowait()
            except queue.Empty:
                return
            if child is not None:
                child.kill()
