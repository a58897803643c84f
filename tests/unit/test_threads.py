"""Native thread names (app/threads.py): what `top -H`, /proc and bench/cpu.py read."""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path

from app.periodic import Periodic
from app.threads import name_native_thread
from tests.unit.test_runner import wait_until
from worker.loop import LoopThread


def _kernel_name(tid: int) -> str:
    return Path(f"/proc/self/task/{tid}/comm").read_text().strip()


def test_a_thread_takes_its_own_name_cut_to_the_kernels_fifteen_bytes() -> None:
    seen: dict[str, object] = {}

    def run() -> None:
        seen["given"] = name_native_thread()
        seen["name"] = _kernel_name(threading.get_native_id())

    t = threading.Thread(target=run, name="llmq-stream-publisher")
    t.start()
    t.join()
    assert seen == {"given": True, "name": "llmq-stream-pub"}


def test_a_name_can_be_given_in_place_of_the_threads() -> None:
    seen: dict[str, str] = {}

    def run() -> None:
        name_native_thread("llmq-task")
        seen["name"] = _kernel_name(threading.get_native_id())

    t = threading.Thread(target=run, name="ThreadPoolExecutor-0_3")
    t.start()
    t.join()
    assert seen["name"] == "llmq-task"


def test_the_main_thread_keeps_the_process_name() -> None:
    """The main thread's name is the process's (`ps`, `pgrep`); under gevent every greenlet
    runs on it, so naming it would rename the API process."""
    assert threading.current_thread() is threading.main_thread()
    before = _kernel_name(threading.get_native_id())
    assert name_native_thread("llmq-renamed") is False
    assert _kernel_name(threading.get_native_id()) == before


def test_a_periodic_thread_runs_under_its_name() -> None:
    names: list[str] = []
    periodic = Periodic(
        "llmq-sweeper",
        0.01,
        lambda: names.append(_kernel_name(threading.get_native_id())),
        log=logging.getLogger("test"),
        at_start=True,
    )
    periodic.start()
    try:
        wait_until(lambda: bool(names))
    finally:
        periodic.stop()
        periodic.join(5)
    assert names[0] == "llmq-sweeper"


def test_the_engine_loops_executor_threads_have_their_own_name() -> None:
    """A thread takes its creator's kernel name: without a name of their own, the loop's
    executor threads (where vLLM runs some of its work) would be counted as the loop."""
    loop = LoopThread()
    loop.start()
    try:

        async def executor_thread_name() -> str:
            running = asyncio.get_running_loop()
            return await running.run_in_executor(None, lambda: _kernel_name(threading.get_native_id()))

        assert loop.call(executor_thread_name(), timeout=10) == "llmq-loop-exec_"
    finally:
        loop.stop()
