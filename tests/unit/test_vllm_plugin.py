"""The plugin's parent-death signal, without vLLM: a process started the way vLLM starts its
engine processes (spawned and loading the plugin, or forked) dies with an llmq worker that
is killed with SIGKILL; processes outside an llmq worker are left alone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]

# What the engine core does first: load the plugin (then say so). Then it lives on,
# holding its KV cache.
ENGINE = """
import sys, time
from worker.vllm_plugin import die_with_parent
die_with_parent()
print("armed", flush=True)
if len(sys.argv) > 1:
    open(sys.argv[1], "w").close()
time.sleep(120)
"""

# Stands in for an llmq worker: arms its children, starts one as vLLM would, prints its pid.
WORKER = """
import multiprocessing, subprocess, sys, time
from worker.vllm_plugin import arm_children
arm_children()
if sys.argv[1] == "spawn":  # a fresh interpreter that loads the plugin, as the engine core does
    child = subprocess.Popen([sys.executable, "-c", sys.argv[2], sys.argv[3]], stdout=subprocess.DEVNULL)
    pid = child.pid
else:  # forked: plugins are not loaded again in the child
    proc = multiprocessing.get_context("fork").Process(target=time.sleep, args=(120,))
    proc.start()
    pid = proc.pid
print(pid, flush=True)
time.sleep(120)
"""


def python(code: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        stdout=subprocess.PIPE,
        text=True,
    )


def gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def start_worker(*args: str) -> tuple[subprocess.Popen[str], int]:
    worker = python(WORKER, *args)
    assert worker.stdout is not None
    return worker, int(worker.stdout.readline())


def test_a_spawned_engine_process_dies_with_a_killed_worker(tmp_path: Path) -> None:
    armed = tmp_path / "armed"
    worker, engine = start_worker("spawn", ENGINE, str(armed))
    try:
        deadline = time.monotonic() + 30
        while not armed.exists():
            assert time.monotonic() < deadline and not gone(engine, 0), "the engine process never armed"
            time.sleep(0.05)
        worker.kill()
        assert gone(engine, 5), "the engine process outlived its worker"
    finally:
        worker.kill()
        worker.wait()
        if not gone(engine, 0):
            os.kill(engine, signal.SIGKILL)


def test_a_forked_engine_process_dies_with_a_killed_worker() -> None:
    worker, engine = start_worker("fork")
    try:
        assert not gone(engine, 0.2)
        worker.kill()
        assert gone(engine, 5), "the engine process outlived its worker"
    finally:
        worker.kill()
        worker.wait()
        if not gone(engine, 0):
            os.kill(engine, signal.SIGKILL)


def test_an_engine_process_whose_worker_died_before_it_armed_exits() -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    engine = python(ENGINE, env={"_LLMQ_ENGINE_PARENT_PID": str(dead.pid)})
    try:
        assert engine.wait(30) == 1
    finally:
        engine.kill()
        engine.wait()


def test_processes_outside_an_llmq_worker_are_left_alone() -> None:
    # No worker named (vLLM used by someone else), or one that is not this process's
    # parent (the variable inherited from further up): not armed, and not exited.
    for env in ({}, {"_LLMQ_ENGINE_PARENT_PID": str(os.getppid())}):
        engine = python(ENGINE, env=env)
        try:
            assert engine.stdout is not None and engine.stdout.readline() == "armed\n"
            assert engine.poll() is None
        finally:
            engine.kill()
            engine.wait()
