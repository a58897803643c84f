"""A dedicated event-loop thread: the engine lives on it, task threads submit into it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from app.threads import name_native_thread

T = TypeVar("T")

# The loop's executor threads' name (`llmq-loop-exec_<n>`; the kernel keeps 15 bytes).
EXECUTOR_THREADS = "llmq-loop-exec"


class LoopThread:
    def __init__(self, name: str = "llmq-engine-loop") -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._started = threading.Event()

    def _run(self) -> None:
        name_native_thread()
        # A thread takes its creator's kernel name: the loop's executor threads (vLLM runs
        # some of its work there) would show as the loop itself. They get their own.
        self._loop.set_default_executor(
            concurrent.futures.ThreadPoolExecutor(
                thread_name_prefix=EXECUTOR_THREADS, initializer=name_native_thread
            )
        )
        asyncio.set_event_loop(self._loop)
        self._loop.call_soon(self._started.set)
        self._loop.run_forever()

    def start(self) -> None:
        self._thread.start()
        self._started.wait()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run `coro` on the loop and wait for its result in the calling thread."""
        return self.submit(coro).result(timeout)

    def stop(self) -> None:
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
