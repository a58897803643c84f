"""The lease keeper tells a lost lease from a job that simply ended between its looks."""

from __future__ import annotations

from typing import Any

from worker.control import LeaseKeeper
from worker.runner import Inflight


class Runner:
    def __init__(self, *snapshots: list[Inflight]) -> None:
        self._snapshots = list(snapshots)
        self.lost: list[str] = []
        self.cancelled: list[str] = []

    def inflight(self) -> list[Inflight]:
        return self._snapshots.pop(0) if len(self._snapshots) > 1 else self._snapshots[0]

    def lose(self, job_id: str) -> None:
        self.lost.append(job_id)

    def cancel(self, job_id: str) -> bool:
        self.cancelled.append(job_id)
        return True


class Store:
    def __init__(self, owned: dict[str, tuple[int, bool]]) -> None:
        self.owned = owned

    def extend_leases(self, owner: str, lease_seconds: float) -> dict[str, tuple[int, bool]]:
        return self.owned


def keeper(store: Any, runner: Any) -> LeaseKeeper:
    return LeaseKeeper(store, runner, "w1", 30)


def test_a_job_that_ended_meanwhile_is_not_a_lost_lease() -> None:
    a, b = Inflight("a", 1, "r-a"), Inflight("b", 1, "r-b")
    runner = Runner([a, b], [b])  # `a` finished and was saved between the two looks
    keeper(Store({"b": (1, False)}), runner).tick()
    assert runner.lost == []


def test_a_job_taken_over_or_cancelled_is_stopped() -> None:
    a, b, c = Inflight("a", 1, "r-a"), Inflight("b", 1, "r-b"), Inflight("c", 1, "r-c")
    runner = Runner([a, b, c])
    keeper(Store({"b": (2, False), "c": (1, True)}), runner).tick()
    assert runner.lost == ["a", "b"] and runner.cancelled == ["c"]
