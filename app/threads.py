"""Native names for llmq's threads.

Python 3.11 names its Thread objects but leaves the kernel's name of every thread the
process's, so `top -H`, `ps -L`, /proc/<pid>/task/<tid>/comm and a debugger showed a
worker's engine loop, task threads and feeder all as `python`, and CPU could only be
tied to a thread with py-spy (bench/cpu.py reads it by name per thread). The name is the
Thread's own, cut to the kernel's 15 bytes.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading

log = logging.getLogger("llmq.threads")

_PR_SET_NAME = 15
_NAME_BYTES = 15


def name_native_thread(name: str | None = None) -> bool:
    """Give the calling OS thread `name` (default: its Thread's name) as its kernel name;
    whether it was given. Never the process's main thread, whose name is the process's
    (`ps`, `pgrep`): under gevent every greenlet runs on it. Off Linux, nothing."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        # The kernel's id of this thread, whatever gevent made of `threading`'s.
        tid = int(os.readlink("/proc/thread-self").rsplit("/", 1)[1])
        if tid == os.getpid():
            return False
        raw = (name or threading.current_thread().name).encode("utf-8", "replace")[:_NAME_BYTES]
        done: int = ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, ctypes.c_char_p(raw), 0, 0, 0)
        return done == 0
    except (OSError, ValueError, AttributeError) as exc:
        log.debug("thread name not set", extra={"error": f"{type(exc).__name__}: {exc}"})
        return False
