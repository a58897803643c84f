"""Prometheus metrics, read at scrape time from Postgres and Redis (the shared state), so
every API process answers for the whole cluster and nothing is counted in process memory.
Only active work is counted in Postgres: the partial indexes keep a scrape cheap however
many finished jobs the table holds."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from redis import Redis
from sqlalchemy import text

from app.db import Database
from app.liveness import Liveness
from app.services.health import live_workers

_ACTIVE_JOBS = text(
    """
    SELECT status, model, batch_id IS NOT NULL AS batch_line, count(*) FROM jobs
    WHERE status IN ('queued', 'running') GROUP BY 1, 2, 3
    """
)
_BATCHES = text("SELECT status, count(*) FROM batches GROUP BY 1")


@dataclass
class Family:
    name: str
    help: str
    kind: str = "gauge"
    samples: list[tuple[dict[str, str], float]] = field(default_factory=list)

    def add(self, value: float, **labels: str) -> None:
        self.samples.append((labels, value))

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} {self.kind}"
        for labels, value in self.samples:
            inner = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))
            yield f"{self.name}{{{inner}}} {value:g}" if inner else f"{self.name} {value:g}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class MetricsService:
    def __init__(
        self, db: Database, redis: Redis[bytes], liveness: Liveness, served: Callable[[], frozenset[str]]
    ) -> None:
        """`served`: the served models now (app/services/models.py's registry)."""
        self._db = db
        self._redis = redis
        self._liveness = liveness
        self._served = served

    def render(self, *, details: bool = True) -> str:
        """The exposition text. Without `details`, per-worker series (labelled with worker
        names, which hold host names and pids) are summed per model instead."""
        families = [*self._database(), *self._broker(details)]
        return "\n".join(line for f in families for line in f.render()) + "\n"

    def _database(self) -> list[Family]:
        up = Family("llmq_database_up", "1 when Postgres answered this scrape.")
        jobs = Family("llmq_jobs_active", "Jobs queued or running, by model and kind.")
        batches = Family("llmq_batches", "Batches by status.")
        took = Family("llmq_scrape_database_seconds", "Time the Postgres queries of this scrape took.")
        start = time.perf_counter()
        try:
            with self._db.session() as s:
                for status, model, batch_line, count in s.execute(_ACTIVE_JOBS):
                    jobs.add(count, status=status, model=model, kind="batch_line" if batch_line else "single")
                for status, count in s.execute(_BATCHES):
                    batches.add(count, status=status)
            up.add(1)
        except Exception:  # noqa: BLE001 - a scrape reports the outage, never fails
            up.add(0)
        took.add(time.perf_counter() - start)
        return [up, jobs, batches, took]

    def _broker(self, details: bool) -> list[Family]:
        up = Family("llmq_redis_up", "1 when Redis answered this scrape.")
        depth = Family("llmq_queue_depth", "Messages waiting in the broker, by model.")
        unacked = Family("llmq_messages_unacked", "Messages taken by workers and not yet acknowledged.")
        workers = Family("llmq_workers_consuming", "Workers that proved they consume, by model.")
        if details:
            inflight = Family("llmq_worker_inflight", "Jobs a worker is running now.")
            capacity = Family("llmq_worker_capacity", "Jobs a worker runs at once at most.")
        else:
            inflight = Family("llmq_model_inflight", "Jobs the live workers of a model are running now.")
            capacity = Family("llmq_model_capacity", "Jobs the live workers of a model run at once at most.")
        summed: dict[str, list[float]] = {}
        try:
            served = self._served()
            for model in sorted(served):
                depth.add(self._liveness.depth(model), model=model)
            unacked.add(self._liveness.unacked_count())
            per_model: dict[str, int] = dict.fromkeys(served, 0)
            for w in live_workers(self._redis):
                model = str(w.get("model", ""))
                if w.get("consuming"):
                    per_model[model] = per_model.get(model, 0) + 1
                running, most = float(w.get("inflight") or 0), float(w.get("capacity") or 0)
                if details:
                    inflight.add(running, worker=str(w.get("name", "")), model=model)
                    capacity.add(most, worker=str(w.get("name", "")), model=model)
                total = summed.setdefault(model, [0.0, 0.0])
                total[0] += running
                total[1] += most
            for model, count in sorted(per_model.items()):
                workers.add(count, model=model)
            if not details:
                for model, (running, most) in sorted(summed.items()):
                    inflight.add(running, model=model)
                    capacity.add(most, model=model)
            up.add(1)
        except Exception:  # noqa: BLE001
            up.add(0)
        return [up, depth, unacked, workers, inflight, capacity]
