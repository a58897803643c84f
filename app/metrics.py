"""The API's own metrics and how `/metrics` exposes them, with `prometheus_client` and
Prometheus's naming (base units, `_total` counters, `_seconds` histograms).

Per process: HTTP requests by route and status with their latency, and jobs submitted by
model and kind. The route is the URL rule (`/v2/jobs/<job_id>`), never the raw path, which
holds ids and whatever a client sends; so are methods outside HTTP's own bounded to `other`.

Under gunicorn a replica is several processes and a scrape reaches any one of them: each
process records into files under `PROMETHEUS_MULTIPROC_DIR` (made and wiped by
app/gunicorn_conf.py, before any worker imports prometheus_client) and a scrape reads them
all. Figures computed at scrape time (build info, and the cluster figures of
app/services/metrics.py) are added per scrape and never recorded in those files.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Callable, Iterable
from importlib import metadata

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4

# Seconds: most answers take milliseconds; SSE streams and synchronous chat waits take up to
# minutes (an SSE stream is observed when it ends, with its whole duration).
HTTP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0)
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
# The route label of a request no URL rule matched (404, 405 on an unknown path).
UNMATCHED = "unmatched"
# Where the Flask app leaves the matched URL rule for the WSGI middleware (app/api/access.py).
ROUTE_KEY = "llmq.route"


def multiprocess_dir() -> str | None:
    return os.environ.get(MULTIPROC_ENV) or None


def llmq_version() -> str:
    try:
        return metadata.version("llmq")
    except metadata.PackageNotFoundError:
        return "unknown"


def build_info(component: str, **labels: str) -> GaugeMetricFamily:
    """`llmq_build_info` (always 1): what runs, in its labels."""
    values = {
        "component": component,
        "version": llmq_version(),
        "python": platform.python_version(),
        **labels,
    }
    family = GaugeMetricFamily(
        "llmq_build_info", "What this process runs: llmq's version and its component.", labels=list(values)
    )
    family.add_metric(list(values.values()), 1.0)
    return family


class Collectors(Collector):
    """Several collectors read as one (what `generate_latest` takes)."""

    def __init__(self, parts: Iterable[Collector]) -> None:
        self._parts = list(parts)

    def collect(self) -> Iterable[Metric]:
        for part in self._parts:
            yield from part.collect()


class Computed(Collector):
    """Families computed at scrape time by `make`."""

    def __init__(self, make: Callable[[], Iterable[Metric]]) -> None:
        self._make = make

    def collect(self) -> Iterable[Metric]:
        return self._make()


class ApiMetrics:
    """One per Flask app. In multiprocess mode the values live in the files (shared by the
    process's apps); otherwise in this object's registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        labels = ["route", "method", "status"]
        self.requests = Counter(
            "llmq_http_requests",
            "HTTP requests answered, by route (the URL rule), method and status code.",
            labels,
            registry=self.registry,
        )
        self.duration = Histogram(
            "llmq_http_request_duration_seconds",
            "Time from a request's arrival to the end of its response body, by route, method and status.",
            labels,
            buckets=HTTP_BUCKETS,
            registry=self.registry,
        )
        self.submitted = Counter(
            "llmq_jobs_submitted",
            "Jobs accepted, by model and kind (`single`: one request; `batch_line`: a line of a batch).",
            ["model", "kind"],
            registry=self.registry,
        )
        # Each series's children, looked up once: prometheus_client's `labels()` takes a lock
        # and builds its key on every call (a request's two: 4.2 -> 1.7 µs). Keyed by the
        # label values, so these hold the children the metrics hold anyway, no more.
        self._requests: dict[tuple[str, str, str], tuple[Counter, Histogram]] = {}
        self._submitted: dict[tuple[str, str], Counter] = {}

    def observe_request(self, route: str | None, method: str, status: int, seconds: float) -> None:
        labels = (route or UNMATCHED, method if method in METHODS else "other", str(status))
        series = self._requests.get(labels)
        if series is None:
            series = self._requests[labels] = (self.requests.labels(*labels), self.duration.labels(*labels))
        series[0].inc()
        series[1].observe(seconds)

    def count_submitted(self, model: str, kind: str, count: int = 1) -> None:
        if count > 0:
            child = self._submitted.get((model, kind))
            if child is None:
                child = self._submitted[(model, kind)] = self.submitted.labels(model, kind)
            child.inc(count)

    def exposition(self, *computed: Collector) -> bytes:
        """The text a scrape gets: every process's recorded figures, then `computed`."""
        if multiprocess_dir() is not None:
            files = CollectorRegistry()
            MultiProcessCollector(files)  # type: ignore[no-untyped-call]
            recorded: Collector = files
        else:
            recorded = self.registry
        return generate_latest(Collectors([recorded, *computed]))
