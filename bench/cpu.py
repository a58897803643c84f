"""CPU time by process, read from /proc/<pid>/stat (utime, stime, cutime, cstime) before
and after a measured stretch: API (gunicorn master and workers), worker (the Celery worker
process and its children except vLLM's engine core), the engine core, Postgres (the server
and its backends) and Redis. A rate depends on the machine; CPU per job mostly does not.

A group's time is the sum over its live processes of their own and their reaped children's
times, so a backend that exits in between still counts (through the postmaster's cutime).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import psutil

from app.cli.stack import Stack

GROUPS = ("api", "worker", "engine", "postgres", "redis")
# vLLM titles its engine core process "VLLM::EngineCore" (set_process_title).
ENGINE_CORE = "EngineCore"


def _seconds(proc: psutil.Process) -> float:
    t = proc.cpu_times()  # /proc/<pid>/stat fields 14-17, in seconds
    return float(t.user + t.system + t.children_user + t.children_system)


def _tree(pid: int) -> list[psutil.Process]:
    try:
        top = psutil.Process(pid)
        return [top, *top.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _is_engine(proc: psutil.Process) -> bool:
    try:
        return ENGINE_CORE in proc.name() or any(ENGINE_CORE in part for part in proc.cmdline()[:1])
    except psutil.Error:
        return False


def _by_name(name: str) -> list[psutil.Process]:
    """Every process called `name` (stores not started by the stack: shared, so noisy)."""
    return [p for p in psutil.process_iter(["name"]) if p.info["name"] and p.info["name"].startswith(name)]


def processes(stack: Stack) -> dict[str, list[psutil.Process]]:
    """The stack's processes by group, as they are now."""
    groups: dict[str, list[psutil.Process]] = {g: [] for g in GROUPS}
    if "api" in stack.procs:
        groups["api"] = _tree(stack.procs["api"].pid)
    if "worker" in stack.procs:
        engine_pids: set[int] = set()
        tree = _tree(stack.procs["worker"].pid)
        for proc in tree:
            if _is_engine(proc):
                engine = _tree(proc.pid)
                groups["engine"].extend(engine)
                engine_pids.update(p.pid for p in engine)
        groups["worker"] = [p for p in tree if p.pid not in engine_pids]
    servers = {s.name: s for s in stack.servers}
    for group, name in (("postgres", "postgres"), ("redis", "redis")):
        server = next((s for key, s in servers.items() if key.startswith(name)), None)
        groups[group] = _tree(server.proc.pid) if server is not None else _by_name(name)
    return groups


def _sample(groups: dict[str, list[psutil.Process]]) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    for group, procs in groups.items():
        seen: dict[int, float] = {}
        for proc in procs:
            try:
                seen[proc.pid] = _seconds(proc)
            except psutil.Error:
                continue
        out[group] = seen
    return out


@dataclass
class CpuUse:
    """CPU seconds each group spent between `start` and `stop`."""

    seconds: dict[str, float] = field(default_factory=dict)

    def per_unit_ms(self, units: int) -> dict[str, float]:
        """Milliseconds per job or line, by group."""
        return {g: round(s * 1e3 / max(units, 1), 3) for g, s in self.seconds.items()}


@contextmanager
def measure(stack: Stack) -> Iterator[CpuUse]:
    """CPU by group over the `with` block; processes born inside it count from zero."""
    use = CpuUse()
    before = _sample(processes(stack))
    try:
        yield use
    finally:
        after = _sample(processes(stack))
        for group in GROUPS:
            start = before.get(group, {})
            end = after.get(group, {})
            use.seconds[group] = round(sum(end[pid] - start.get(pid, 0.0) for pid in end), 4)


def own_process_seconds(pids: Iterable[int]) -> float:
    """CPU seconds the given processes (and their reaped children) have used so far."""
    total = 0.0
    for pid in pids:
        try:
            total += _seconds(psutil.Process(pid))
        except psutil.Error:
            continue
    return total
