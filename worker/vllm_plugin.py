"""A vLLM general plugin (entry point `vllm.general_plugins`), run by vLLM in each of its
processes: the frontend, the engine core and the model worker.

It does three things:

- On CPUs with AMX, vLLM's bf16 attention uses AMX tiles, which Linux only allows after a
  process asks for them (`arch_prctl(ARCH_REQ_XCOMP_PERM)`). Compiled mode asks as a side
  effect; eager mode does not and dies with an illegal instruction. This asks, once per
  process, where AMX exists.
- vLLM stops its engine processes only on a graceful close: after `kill -9` of an llmq
  worker they kept their KV cache (GiBs) and, on CPU, a spinning core. In processes started
  by an llmq worker (the worker names itself in `PARENT_ENV` before starting the engine),
  this asks the kernel to SIGKILL the process when its parent dies.
- In those same processes, Python warnings become log records (`py.warnings`), so they are
  written in llmq's log format like the rest of the engine's lines (vLLM applies llmq's
  logging configuration there itself, from `VLLM_LOGGING_CONFIG_PATH`).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys

# Set by the llmq worker to its pid before it starts the engine; each engine process that
# arms itself rewrites it to its own pid, so its children check against their own parent.
# It travels in the environment because it must reach processes vLLM spawns, before any of
# llmq's settings are loaded there; vLLM users outside llmq never set it.
PARENT_ENV = "_LLMQ_ENGINE_PARENT_PID"

_PR_SET_PDEATHSIG = 1
_hooked = False


def setup() -> None:
    request_amx()
    die_with_parent()
    if _expected_parent() is not None:
        logging.captureWarnings(True)


def request_amx() -> None:
    import torch

    cpu = getattr(torch, "cpu", None)
    if cpu is not None and getattr(cpu, "_is_amx_tile_supported", lambda: False)():
        cpu._init_amx()


def arm_children() -> None:
    """Called by the llmq worker before it starts the engine: every engine process it
    starts from now on dies with it."""
    os.environ[PARENT_ENV] = str(os.getpid())
    _hook_forks()


def die_with_parent() -> None:
    """Arm the parent-death signal in an engine process spawned by an llmq worker (or one
    of its engine processes); in the worker itself, arm every child it forks instead
    (vLLM forks rather than spawns where CUDA is not initialised yet, and a forked child
    does not load plugins again). Outside llmq, nothing."""
    expected = _expected_parent()
    if expected is None:
        return
    if expected == os.getpid():
        _hook_forks()
        return
    _arm(expected)


def _hook_forks() -> None:
    global _hooked
    if not _hooked:  # a forked child inherits its parent's hook
        _hooked = True
        os.register_at_fork(after_in_child=_arm_forked)


def _expected_parent() -> int | None:
    value = os.environ.get(PARENT_ENV, "")
    return int(value) if value.isdigit() else None


def _arm_forked() -> None:
    expected = _expected_parent()
    if expected is not None and expected != os.getpid():
        _arm(expected)


def _arm(expected: int) -> None:
    if not sys.platform.startswith("linux"):
        return  # no parent-death signal: the worker's close still stops a graceful exit's engine
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    if prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return
    if os.getppid() != expected:
        if _alive(expected):
            # Not started by that process: the variable was inherited from further up
            # (a test process that ran an engine itself, say). Not ours to arm.
            prctl(_PR_SET_PDEATHSIG, 0, 0, 0, 0)
            return
        # The parent died before the signal was armed: nobody will send it now.
        os._exit(1)
    os.environ[PARENT_ENV] = str(os.getpid())
    _hook_forks()  # its own forked children (vLLM's executor under fork) arm themselves too


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
