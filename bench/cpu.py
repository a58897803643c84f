"""CPU time by process, read from /proc/<pid>/stat (utime, stime, cutime, cstime) before
and after a measured stretch: API (gunicorn master and workers), worker (the Celery worker
process and its children except vLLM's engine core), the engine core, Postgres (the server
and its backends) and Redis. A rate depends on the machine; CPU per job mostly does not.

A group's time is the sum over its live processes of their own and their reaped children's
times, so a backend that exits in between still counts (through the postmaster's cutime).

The worker's own process is also cut by thread (`CpuUse.threads`), each read from
/proc/<pid>/task/<tid>/schedstat under its kernel name (app/threads.py names llmq's threads:
the engine's loop, Celery's task threads, the stream publisher, the feeder, ...; the main
thread, Celery's consumer, is `main`). A thread that ends inside the stretch loses its time.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

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


MAIN_THREAD = "main"
# A process's threads: id -> (kernel name, CPU seconds).
Threads = dict[int, tuple[str, float]]


def thread_seconds(pid: int, proc_root: Path = Path("/proc")) -> Threads:
    """CPU seconds of each live thread of `pid`, with its kernel name (the main thread's as
    MAIN_THREAD); {} once the process is gone. The time is the scheduler's own count in
    nanoseconds (`schedstat`'s first field): `stat`'s utime and stime come in whole clock
    ticks, and 64 task threads each a tick short or over made the task threads' figure of
    B1 wrong by up to 10 ms a job. Without `schedstat` (a kernel built without it), `stat`."""
    tick = os.sysconf("SC_CLK_TCK")
    out: Threads = {}
    try:
        tids = [int(t) for t in os.listdir(proc_root / str(pid) / "task")]
    except OSError:
        return out
    for tid in tids:
        task = proc_root / str(pid) / "task" / str(tid)
        try:
            stat = (task / "stat").read_text()
            try:
                seconds = int((task / "schedstat").read_text().split()[0]) / 1e9
            except FileNotFoundError:
                fields = stat[stat.rindex(")") + 2 :].split()
                seconds = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        except OSError:
            continue  # ended meanwhile
        # The name is between the first "(" and the last ")": it may hold either.
        out[tid] = (MAIN_THREAD if tid == pid else stat[stat.index("(") + 1 : stat.rindex(")")], seconds)
    return out


def by_thread_name(before: Threads, after: Threads) -> dict[str, float]:
    """Seconds each thread name spent between two `thread_seconds` readings, most first
    (threads of one name, such as Celery's task threads, summed)."""
    spent: Counter[str] = Counter()
    for tid, (name, seconds) in after.items():
        spent[name] += seconds - before.get(tid, (name, 0.0))[1]
    return {name: round(s, 4) for name, s in spent.most_common() if s > 0}


@dataclass
class CpuUse:
    """CPU seconds each group spent between `start` and `stop`, and the worker's process's
    by thread name."""

    seconds: dict[str, float] = field(default_factory=dict)
    threads: dict[str, float] = field(default_factory=dict)

    def per_unit_ms(self, units: int) -> dict[str, float]:
        """Milliseconds per job or line, by group."""
        return {g: round(s * 1e3 / max(units, 1), 3) for g, s in self.seconds.items()}

    def threads_per_unit_ms(self, units: int) -> dict[str, float]:
        """Milliseconds per job or line of the worker's process, by thread name."""
        return {t: round(s * 1e3 / max(units, 1), 3) for t, s in self.threads.items()}


@contextmanager
def measure(stack: Stack) -> Iterator[CpuUse]:
    """CPU by group over the `with` block; processes born inside it count from zero."""
    use = CpuUse()
    worker = stack.procs["worker"].pid if "worker" in stack.procs else None
    threads_before = thread_seconds(worker) if worker is not None else {}
    before = _sample(processes(stack))
    try:
        yield use
    finally:
        after = _sample(processes(stack))
        if worker is not None:
            use.threads = by_thread_name(threads_before, thread_seconds(worker))
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
