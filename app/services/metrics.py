"""Cluster figures for /metrics, read at scrape time from Postgres and Redis (the shared
state): jobs queued and running per model, batches by status, broker depth, workers, and the
signal an autoscaler reads (queued work and seconds to the nearest batch deadline, per model).

They are the same whichever API replica reads them, so only one replica sends them: the
holder of a lease in Redis (`llmq:leader:metrics`), which each of its scrapes renews for
`LLMQ_METRICS_LEASE_SECONDS`. Another replica takes it over only once it has lapsed, so
`sum()` over replicas never doubles a figure as long as the lease outlives Prometheus's
scrape interval (a replica that stops sending a series has it marked stale by Prometheus at
its next scrape). Every replica sends `llmq_cluster_reporter` (1 on the holder, else 0):
`sum(llmq_cluster_reporter)` is 1 while the figures are reported; it is 0 when Redis is
unreachable, and then no replica sends them (a lease cannot be checked).

Only active work is counted in Postgres: the partial indexes keep a scrape cheap however
many finished jobs the table holds."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from redis import Redis
from redis.exceptions import RedisError
from sqlalchemy import text

from app.db import Database
from app.liveness import Liveness
from app.services.health import live_workers

LEASE_KEY = "llmq:leader:metrics"

# Take the lease if it is free, or renew it if this replica holds it: 1 when held.
_HOLD = """
local owner = redis.call('GET', KEYS[1])
if owner == ARGV[1] then redis.call('PEXPIRE', KEYS[1], ARGV[2]) return 1 end
if not owner then redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]) return 1 end
return 0
"""

# One pass over the active rows: counts per status, model and kind, and the nearest
# deadline of each model's unfinished batch lines.
_ACTIVE_JOBS = text(
    """
    SELECT status, model, batch_id IS NOT NULL AS batch_line, count(*),
           extract(epoch FROM min(deadline_at) - now())::float8 AS to_deadline
    FROM jobs WHERE status IN ('queued', 'running') GROUP BY 1, 2, 3
    """
)
_BATCHES = text("SELECT status, count(*) FROM batches GROUP BY 1")


class ClusterLease:
    def __init__(self, redis: Redis[bytes], owner: str, *, lease_seconds: float) -> None:
        self._redis = redis
        self._owner = owner
        self._lease_ms = str(max(1, int(lease_seconds * 1000)))
        self._hold = redis.register_script(_HOLD)

    @property
    def owner(self) -> str:
        return self._owner

    def hold(self) -> bool:
        """Whether this replica holds the lease now (taken or renewed by this call).

        Raises:
            RedisError: Redis did not answer.
        """
        return bool(self._hold(keys=[LEASE_KEY], args=[self._owner, self._lease_ms]))


def _gauge(name: str, documentation: str, labels: list[str] | None = None) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, labels=labels)


class MetricsService:
    def __init__(
        self,
        db: Database,
        redis: Redis[bytes],
        liveness: Liveness,
        served: Callable[[], frozenset[str]],
        lease: ClusterLease,
    ) -> None:
        """`served`: the served models now (app/services/models.py's registry)."""
        self._db = db
        self._redis = redis
        self._liveness = liveness
        self._served = served
        self._lease = lease

    def collect(self, *, details: bool = True) -> Iterator[Metric]:
        """The cluster families when this replica holds the lease; `llmq_cluster_reporter`
        always. Without `details`, per-worker series (labelled with worker names, which hold
        host names and pids) are summed per model instead."""
        reporter = _gauge(
            "llmq_cluster_reporter",
            "1 on the one API replica that reports the cluster figures (llmq_jobs_active, "
            "llmq_queue_depth, ...), else 0.",
        )
        try:
            holds = self._lease.hold()
        except RedisError:
            holds = False
        reporter.add_metric([], 1.0 if holds else 0.0)
        yield reporter
        if holds:
            yield from self._database()
            yield from self._broker(details)

    def _database(self) -> Iterator[Metric]:
        up = _gauge("llmq_database_up", "1 when Postgres answered this scrape.")
        jobs = _gauge(
            "llmq_jobs_active",
            "Jobs queued or running, by kind, model and status.",
            ["kind", "model", "status"],
        )
        queued = _gauge(
            "llmq_model_queued_jobs",
            "Jobs of a model waiting for a worker (single jobs and batch lines, sent to the broker or "
            "not): the work an autoscaler sizes the model's worker pool by.",
            ["model"],
        )
        deadline = _gauge(
            "llmq_model_deadline_seconds",
            "Seconds until the nearest deadline among a model's unfinished batch lines (negative when "
            "passed); absent for a model with none.",
            ["model"],
        )
        batches = _gauge("llmq_batches", "Batches by status.", ["status"])
        took = _gauge("llmq_scrape_database_seconds", "Time the Postgres queries of this scrape took.")
        start = time.perf_counter()
        waiting: dict[str, float] = dict.fromkeys(self._served_or_empty(), 0.0)
        nearest: dict[str, float] = {}
        try:
            with self._db.session() as s:
                for status, model, batch_line, count, to_deadline in s.execute(_ACTIVE_JOBS):
                    kind = "batch_line" if batch_line else "single"
                    jobs.add_metric([kind, model, status], float(count))
                    if status == "queued":
                        waiting[model] = waiting.get(model, 0.0) + float(count)
                    if to_deadline is not None:
                        nearest[model] = min(nearest.get(model, to_deadline), float(to_deadline))
                for status, count in s.execute(_BATCHES):
                    batches.add_metric([status], float(count))
            up.add_metric([], 1.0)
        except Exception:  # noqa: BLE001 - a scrape reports the outage, never fails
            up.add_metric([], 0.0)
        for model, count in sorted(waiting.items()):
            queued.add_metric([model], count)
        for model, seconds in sorted(nearest.items()):
            deadline.add_metric([model], round(seconds, 3))
        took.add_metric([], time.perf_counter() - start)
        yield from (up, jobs, queued, deadline, batches, took)

    def _served_or_empty(self) -> frozenset[str]:
        try:
            return self._served()
        except Exception:  # noqa: BLE001 - the registry reads Redis; the figures still come
            return frozenset()

    def _broker(self, details: bool) -> Iterator[Metric]:
        up = _gauge("llmq_redis_up", "1 when Redis answered this scrape.")
        depth = _gauge("llmq_queue_depth", "Messages waiting in the broker, by model.", ["model"])
        unacked = _gauge("llmq_messages_unacked", "Messages taken by workers and not yet acknowledged.")
        workers = _gauge("llmq_workers_consuming", "Workers that proved they consume, by model.", ["model"])
        if details:
            inflight = _gauge("llmq_worker_inflight", "Jobs a worker is running now.", ["worker", "model"])
            capacity = _gauge(
                "llmq_worker_capacity", "Jobs a worker runs at once at most.", ["worker", "model"]
            )
        else:
            inflight = _gauge(
                "llmq_model_inflight", "Jobs the live workers of a model are running now.", ["model"]
            )
            capacity = _gauge(
                "llmq_model_capacity", "Jobs the live workers of a model run at once at most.", ["model"]
            )
        summed: dict[str, list[float]] = {}
        try:
            served = self._served()
            for model in sorted(served):
                depth.add_metric([model], float(self._liveness.depth(model)))
            unacked.add_metric([], float(self._liveness.unacked_count()))
            per_model: dict[str, int] = dict.fromkeys(served, 0)
            for w in live_workers(self._redis):
                model = str(w.get("model", ""))
                if w.get("consuming"):
                    per_model[model] = per_model.get(model, 0) + 1
                running, most = float(w.get("inflight") or 0), float(w.get("capacity") or 0)
                if details:
                    inflight.add_metric([str(w.get("name", "")), model], running)
                    capacity.add_metric([str(w.get("name", "")), model], most)
                total = summed.setdefault(model, [0.0, 0.0])
                total[0] += running
                total[1] += most
            for model, count in sorted(per_model.items()):
                workers.add_metric([model], float(count))
            if not details:
                for model, (running, most) in sorted(summed.items()):
                    inflight.add_metric([model], running)
                    capacity.add_metric([model], most)
            up.add_metric([], 1.0)
        except Exception:  # noqa: BLE001
            up.add_metric([], 0.0)
        yield from (up, depth, unacked, workers, inflight, capacity)
