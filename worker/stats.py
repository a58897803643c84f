"""What a job cost: tokens per second, peak memory, power and energy.

A sampler thread reads memory (RSS of the worker and its engine processes on CPU, device
memory via NVML on GPU) and board power (NVML) every `interval` seconds into a ring; a
job's figures are the samples inside its time window.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import psutil

from app.periodic import Periodic

log = logging.getLogger("llmq.stats")


@dataclass(frozen=True)
class Sample:
    t: float  # time.monotonic()
    memory_bytes: int
    watts: dict[str, float] = field(default_factory=dict)  # node id -> watts


class PowerSensor(Protocol):
    def read(self) -> dict[str, float]:
        """Board power in watts per device id."""
        ...

    def device_memory(self) -> int | None:
        """Bytes of device memory used by this worker's processes, if known."""
        ...


class NvmlSensor:
    """NVIDIA board power and per-process memory through NVML."""

    def __init__(self, pids: Callable[[], Sequence[int]]) -> None:
        import pynvml  # only present on GPU images (nvidia-ml-py)

        pynvml.nvmlInit()
        self._nvml = pynvml
        self._pids = pids
        self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        self._ids = [pynvml.nvmlDeviceGetUUID(h) for h in self._handles]

    def read(self) -> dict[str, float]:
        return {
            str(uid): self._nvml.nvmlDeviceGetPowerUsage(h) / 1000.0
            for uid, h in zip(self._ids, self._handles, strict=True)
        }

    def device_memory(self) -> int | None:
        mine = set(self._pids())
        total = 0
        for h in self._handles:
            for proc in self._nvml.nvmlDeviceGetComputeRunningProcesses(h):
                if proc.pid in mine and proc.usedGpuMemory:
                    total += int(proc.usedGpuMemory)
        return total


def find_power_sensor(pids: Callable[[], Sequence[int]]) -> PowerSensor | None:
    """NVML when a GPU and the library are present, else None (no sensor, `power_usage`
    is null)."""
    try:
        return NvmlSensor(pids)
    except Exception as exc:  # noqa: BLE001 - absence of NVML is the normal CPU case
        log.info("no power sensor", extra={"reason": type(exc).__name__})
        return None


class ProcessTree:
    """The worker's processes: the roots and their descendants. Finding descendants scans
    all of /proc (psutil's ppid map: about 6 ms with 90 processes on the project's 2-core
    machine, and one scan per root once cost an idle worker's sampler 4 ms of CPU a
    second), so the list is kept and found again every `refresh` seconds, or at the next
    look after one of them is gone; reading a known pid's RSS reads one small file."""

    def __init__(self, roots: Callable[[], Sequence[int]], refresh: float = 30.0) -> None:
        self._roots = roots
        self._refresh = refresh
        self._procs: list[psutil.Process] = []
        self._found_at = float("-inf")

    def _current(self) -> list[psutil.Process]:
        now = time.monotonic()
        if now - self._found_at > self._refresh:
            self._procs = _tree(self._roots())
            self._found_at = now
        return self._procs

    def pids(self) -> list[int]:
        return [proc.pid for proc in self._current()]

    def rss(self) -> int:
        total = 0
        for proc in self._current():
            try:
                total += proc.memory_info().rss
            except psutil.Error:
                self._found_at = float("-inf")  # a process went away: look again next time
        return total


def _tree(pids: Sequence[int]) -> list[psutil.Process]:
    """The processes `pids` name and their descendants; a root found as an earlier root's
    descendant (the engine's processes are the worker's children) costs no scan of its own."""
    found: dict[int, psutil.Process] = {}
    for pid in pids:
        if pid in found:
            continue
        try:
            root = psutil.Process(pid)
            for proc in (root, *root.children(recursive=True)):
                found.setdefault(proc.pid, proc)
        except psutil.Error:
            continue
    return list(found.values())


class ResourceSampler:
    def __init__(
        self,
        processes: ProcessTree,
        sensor: PowerSensor | None,
        *,
        interval: float = 0.5,
        keep_seconds: float = 7200.0,
    ) -> None:
        self._tree = processes
        self._sensor = sensor
        self._interval = interval
        self._ring: deque[Sample] = deque(maxlen=int(keep_seconds / interval) + 1)
        self._lock = threading.Lock()
        # Joules per device since the first sample (trapezoids between samples).
        self._joules: dict[str, float] = {}
        self._periodic = Periodic("llmq-sampler", interval, self.sample, log=log)

    @property
    def has_power(self) -> bool:
        return self._sensor is not None

    def start(self) -> None:
        self._periodic.start()

    def stop(self) -> None:
        self._periodic.stop()

    def sample(self) -> Sample:
        memory = None
        watts: dict[str, float] = {}
        if self._sensor is not None:
            try:
                watts = self._sensor.read()
                memory = self._sensor.device_memory()
            except Exception as exc:  # noqa: BLE001 - a failed read is a missing sample
                log.warning("power sample failed", extra={"error": str(exc)})
        if memory is None:
            memory = self._tree.rss()
        s = Sample(time.monotonic(), memory, watts)
        with self._lock:
            last = self._ring[-1] if self._ring else None
            if last is not None:
                for device, now in watts.items():
                    before = last.watts.get(device)
                    if before is not None:
                        self._joules[device] = (
                            self._joules.get(device, 0.0) + (s.t - last.t) * (before + now) / 2
                        )
            self._ring.append(s)
        return s

    def energy_joules(self) -> dict[str, float]:
        """Energy per device since sampling began; empty without a power sensor."""
        with self._lock:
            return dict(self._joules)

    def window(self, start: float, end: float) -> list[Sample]:
        """Samples taken between `start` and `end` (monotonic). A job shorter than the
        sampling interval gets the latest sample: memory and power move slowly, and
        sampling per job would cost more than the job on a fast engine."""
        inside: list[Sample] = []
        with self._lock:
            # From the newest back to `start` only: the ring holds two hours of samples, and
            # reading all of them for every job cost a worker ~1 ms per job once it was full.
            for s in reversed(self._ring):
                if s.t < start:
                    break
                if s.t <= end:
                    inside.append(s)
            latest = self._ring[-1] if self._ring else None
        if inside:
            inside.reverse()
            return inside
        return [latest if latest is not None else self.sample()]


def generation_stats(
    *,
    prompt_tokens: int,
    completion_tokens: int,
    submitted: float,
    first_token: float | None,
    last_token: float | None,
    peak_memory_bytes: int,
) -> dict[str, Any]:
    """`prompt_tps` = prompt tokens / time to first token; `generation_tps` = (completion
    tokens - 1) / (last token time - first token time). Times are monotonic seconds."""
    prompt_tps = 0.0
    if first_token is not None and first_token > submitted:
        prompt_tps = prompt_tokens / (first_token - submitted)
    generation_tps = 0.0
    if first_token is not None and last_token is not None and last_token > first_token:
        generation_tps = max(0, completion_tokens - 1) / (last_token - first_token)
    return {
        "prompt_tps": round(prompt_tps, 3),
        "generation_tps": round(generation_tps, 3),
        "prompt_tokens": prompt_tokens,
        "generation_tokens": completion_tokens,
        "peak_memory_usage": {"inBytes": int(peak_memory_bytes)},
    }


def power_usage(samples: Sequence[Sample], elapsed: float) -> dict[str, Any] | None:
    """Trapezoid-integrated energy per node; None when no sample carried a reading."""
    nodes: dict[str, list[tuple[float, float]]] = {}
    for s in samples:
        for node, watts in s.watts.items():
            nodes.setdefault(node, []).append((s.t, watts))
    if not nodes:
        return None
    out_nodes = []
    total_avg = 0.0
    total_energy = 0.0
    for node, points in sorted(nodes.items()):
        if len(points) == 1:
            avg = points[0][1]
            energy = avg * elapsed
        else:
            energy = sum((t1 - t0) * (w0 + w1) / 2 for (t0, w0), (t1, w1) in itertools.pairwise(points))
            span = points[-1][0] - points[0][0]
            avg = energy / span if span > 0 else points[-1][1]
            energy = avg * elapsed if elapsed > span else energy
        out_nodes.append({"node_id": node, "samples": len(points), "avg_sys_power": round(avg, 3)})
        total_avg += avg
        total_energy += energy
    return {
        "elapsed_seconds": round(elapsed, 4),
        "nodes": out_nodes,
        "total_avg_sys_power_watts": round(total_avg, 3),
        "total_energy_joules": round(total_energy, 3),
    }


def self_pid() -> list[int]:
    return [os.getpid()]
