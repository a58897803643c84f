"""`llmq worker health`: is a worker process of this host registered and consuming?

A container's healthcheck runs in the worker's own host name and process namespace, so
"this host" is `socket.gethostname()` and a registry entry counts only while the process it
names is running here (an entry left by the container's previous run does not).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from redis import Redis

from app.services.health import live_workers


def worker_names(host: str, pid: int) -> set[str]:
    """The names a worker process registers under: Celery's node name (`llmq-<pid>@<host>`,
    see worker/__main__.py) or, outside Celery, `llmq@<host>:<pid>` (worker/runtime.py)."""
    return {f"llmq-{pid}@{host}", f"llmq@{host}:{pid}"}


def pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, run by another user
        return True
    return True


@dataclass(frozen=True)
class Verdict:
    healthy: bool
    message: str


def check(redis: Redis[bytes], host: str, *, running: Callable[[int], bool] = pid_running) -> Verdict:
    entries: list[dict[str, Any]] = live_workers(redis)
    mine = [
        w
        for w in entries
        if isinstance(w.get("pid"), int) and w.get("name") in worker_names(host, int(w["pid"]))
    ]
    if not mine:
        return Verdict(
            False,
            f"no worker of host {host!r} is in the registry ({len(entries)} registered in all): "
            "its engine may still be starting, or it stopped consuming",
        )
    for w in mine:
        if w.get("consuming") and running(int(w["pid"])):
            detail = f"model {w.get('model')}, {w.get('inflight')} in flight"
            return Verdict(True, f"{w['name']} is consuming ({detail})")
    names = ", ".join(str(w["name"]) for w in mine)
    return Verdict(False, f"{names} registered, but no such process is consuming on this host")
