from __future__ import annotations

import itertools
import os
import subprocess
import sys

import psutil
import pytest

from worker.stats import ProcessTree, ResourceSampler, Sample, generation_stats, power_usage


def test_generation_tps_counts_intervals_between_tokens() -> None:
    stats = generation_stats(
        prompt_tokens=100,
        completion_tokens=11,
        submitted=10.0,
        first_token=10.5,
        last_token=12.5,
        peak_memory_bytes=123,
    )
    assert stats["prompt_tps"] == pytest.approx(200.0)
    assert stats["generation_tps"] == pytest.approx(5.0)  # (11 - 1) / 2 s
    assert stats["peak_memory_usage"] == {"inBytes": 123}
    assert stats["generation_tokens"] == 11


def test_single_token_has_no_generation_rate() -> None:
    stats = generation_stats(
        prompt_tokens=5,
        completion_tokens=1,
        submitted=0.0,
        first_token=1.0,
        last_token=1.0,
        peak_memory_bytes=0,
    )
    assert stats["generation_tps"] == 0.0


def test_power_is_trapezoid_integrated_per_node() -> None:
    samples = [
        Sample(0.0, 0, {"gpu0": 100.0}),
        Sample(1.0, 0, {"gpu0": 200.0}),
        Sample(2.0, 0, {"gpu0": 200.0}),
    ]
    usage = power_usage(samples, elapsed=2.0)
    assert usage is not None
    assert usage["total_energy_joules"] == pytest.approx(350.0)
    assert usage["nodes"] == [{"node_id": "gpu0", "samples": 3, "avg_sys_power": 175.0}]
    assert usage["total_avg_sys_power_watts"] == pytest.approx(175.0)


def test_no_sensor_means_null_power() -> None:
    assert power_usage([Sample(0.0, 10), Sample(1.0, 10)], 1.0) is None


class FakeSensor:
    def __init__(self) -> None:
        self.watts = 50.0

    def read(self) -> dict[str, float]:
        self.watts += 10
        return {"gpu0": self.watts}

    def device_memory(self) -> int | None:
        return 4096


def test_sampler_window_uses_sensor_readings() -> None:
    sampler = ResourceSampler(ProcessTree(lambda: [os.getpid()]), FakeSensor())
    first = sampler.sample()
    second = sampler.sample()
    window = sampler.window(first.t, second.t)
    assert [s.watts["gpu0"] for s in window][:2] == [60.0, 70.0]
    assert all(s.memory_bytes == 4096 for s in window)


def test_rss_of_this_process_is_counted() -> None:
    assert ProcessTree(lambda: [os.getpid()]).rss() > 10 * 2**20


def test_short_job_gets_the_latest_sample() -> None:
    sampler = ResourceSampler(ProcessTree(lambda: [os.getpid()]), FakeSensor())
    latest = sampler.sample()
    assert sampler.window(latest.t + 1, latest.t + 2) == [latest]


def test_sampler_integrates_each_devices_energy() -> None:
    """The worker's `llmq_device_energy_joules_total`: trapezoids between samples."""
    sampler = ResourceSampler(ProcessTree(lambda: [os.getpid()]), FakeSensor())
    assert sampler.energy_joules() == {}
    samples = [sampler.sample() for _ in range(3)]
    expected = sum(
        (b.t - a.t) * (a.watts["gpu0"] + b.watts["gpu0"]) / 2 for a, b in itertools.pairwise(samples)
    )
    assert sampler.energy_joules()["gpu0"] == pytest.approx(expected)
    assert ResourceSampler(ProcessTree(lambda: [os.getpid()]), None).energy_joules() == {}


def test_a_window_holds_exactly_the_samples_between_its_ends_in_time_order() -> None:
    sampler = ResourceSampler(ProcessTree(lambda: [os.getpid()]), FakeSensor())
    samples = [sampler.sample() for _ in range(6)]
    assert sampler.window(samples[1].t, samples[4].t) == samples[1:5]
    assert sampler.window(samples[0].t, samples[0].t) == samples[:1]
    assert sampler.window(samples[5].t, samples[5].t + 10) == samples[5:]


def test_the_process_tree_is_found_once_and_kept_until_a_process_is_gone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An idle worker's sampler scanned /proc for every root at every refresh (4 ms of CPU a
    second here): one scan finds the worker's children, the roots it found are not scanned
    again, and the list is kept between samples until one of its processes is gone."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    looks: list[int] = []
    scans: list[int] = []
    children = psutil.Process.children

    def counted(self: psutil.Process, recursive: bool = False) -> list[psutil.Process]:
        scans.append(self.pid)
        return children(self, recursive=recursive)

    monkeypatch.setattr(psutil.Process, "children", counted)

    def roots() -> list[int]:
        looks.append(1)
        return [os.getpid(), child.pid]  # as the runtime's: the worker, then its engine's

    try:
        tree = ProcessTree(roots)
        assert child.pid in tree.pids()
        for _ in range(5):
            assert tree.rss() > 10 * 2**20
        assert (len(looks), scans) == (1, [os.getpid()])
    finally:
        child.kill()
        child.wait()
    tree.rss()  # the child's memory cannot be read: found again at the next look
    assert child.pid not in tree.pids()
    assert len(looks) == 2
