"""A worker's metrics, on its own `/metrics` port (`LLMQ_METRICS_PORT`; 0 lets the system
pick a free one, so several workers share a host; the port is in the worker's heartbeat
and on the API's `/readyz`).

Per job, observed once when its end is stored (never per token): queue wait, time to first
token, inter-token latency (the job's mean: its deltas arrive coalesced, so single gaps are
not seen), end-to-end time and output tokens per second, by model; jobs ended by status;
prompt and generated tokens. The job's record holds the same queue wait, time to first token
and end-to-end seconds (worker/store.py), so a histogram can be checked against the records.
At scrape time: jobs running and slots, device energy where a power sensor exists (NVML),
`llmq_build_info`. The same port serves vLLM's own metrics (`vllm:` names: scheduler, KV
cache, preemptions), which vLLM records in prometheus_client's default registry, with the
process and Python figures that registry holds.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from app.metrics import CONTENT_TYPE, Collectors, Computed, build_info
from app.threads import name_native_thread

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIEnvironment

QUEUE_BUCKETS = (
    0.01,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    120,
    300,
    600,
    1800,
    3600,
    7200,
    21600,
    86400,
)
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5, 5, 10, 30, 60)
INTER_TOKEN_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.2,
    0.5,
    1,
    2.5,
)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200, 21600, 86400)
TPS_BUCKETS = (1, 2, 5, 10, 20, 35, 50, 75, 100, 150, 200, 300, 500, 1000, 2000, 5000)


@dataclass(frozen=True)
class JobFigures:
    """What one ended job adds to the metrics (seconds; None where the job has no such figure)."""

    model: str
    status: str
    queue_wait_seconds: float | None
    ttft_seconds: float | None
    inter_token_seconds: float | None
    e2e_seconds: float | None
    output_tokens_per_second: float | None
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class _Series:
    """One model's children of the per-job metrics, and of `llmq_jobs_finished` by status."""

    queue_wait: Histogram
    ttft: Histogram
    inter_token: Histogram
    e2e: Histogram
    output_rate: Histogram
    prompt_tokens: Counter
    generation_tokens: Counter
    finished: dict[str, Counter]


@dataclass(frozen=True)
class WorkerState:
    """What the scrape-time figures read from the running worker."""

    model: str
    engine: str
    engine_version: str
    running: Callable[[], int]
    slots: int
    # Joules per device since the worker started; None without a power sensor.
    energy: Callable[[], dict[str, float]] | None = None


class WorkerMetrics:
    def __init__(self, state: WorkerState) -> None:
        self._state = state
        self._series: dict[str, _Series] = {}
        self.registry = CollectorRegistry()
        model = ["model"]

        def histogram(name: str, documentation: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, documentation, model, buckets=buckets, registry=self.registry)

        self.queue_wait = histogram(
            "llmq_job_queue_wait_seconds",
            "Seconds from a job's creation to its first claim, per ended job.",
            QUEUE_BUCKETS,
        )
        self.ttft = histogram(
            "llmq_job_time_to_first_token_seconds",
            "Seconds from a job's submission to the engine to its first token, per ended job that had one.",
            TTFT_BUCKETS,
        )
        self.inter_token = histogram(
            "llmq_job_inter_token_seconds",
            "A job's mean seconds between output tokens (first to last over tokens - 1), per ended job.",
            INTER_TOKEN_BUCKETS,
        )
        self.e2e = histogram(
            "llmq_job_end_to_end_seconds",
            "Seconds from a job's creation to its end, per ended job.",
            E2E_BUCKETS,
        )
        self.output_rate = histogram(
            "llmq_job_output_tokens_per_second",
            "A job's output tokens per second after its first token, per ended job with two tokens or more.",
            TPS_BUCKETS,
        )
        self.finished = Counter(
            "llmq_jobs_finished",
            "Jobs this worker ended, by model and status.",
            ["model", "status"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "llmq_prompt_tokens",
            "Prompt tokens of the jobs this worker ended.",
            model,
            registry=self.registry,
        )
        self.generation_tokens = Counter(
            "llmq_generation_tokens",
            "Tokens generated for the jobs this worker ended.",
            model,
            registry=self.registry,
        )
        self.registry.register(Computed(self._now))
        # The served model's series exist from the start at zero, so the first job's
        # observations are an increase Prometheus sees, not a series appearing.
        for h in (self.queue_wait, self.ttft, self.inter_token, self.e2e, self.output_rate):
            h.labels(state.model)
        for status in ("succeeded", "failed", "cancelled"):
            self.finished.labels(state.model, status)
        self.prompt_tokens.labels(state.model)
        self.generation_tokens.labels(state.model)

    def observe(self, job: JobFigures) -> None:
        """One ended job: a few histogram and counter updates."""
        series = self._series.get(job.model) or self._series_of(job.model)
        if job.queue_wait_seconds is not None:
            series.queue_wait.observe(job.queue_wait_seconds)
        if job.ttft_seconds is not None:
            series.ttft.observe(job.ttft_seconds)
        if job.inter_token_seconds is not None:
            series.inter_token.observe(job.inter_token_seconds)
        if job.e2e_seconds is not None:
            series.e2e.observe(job.e2e_seconds)
        if job.output_tokens_per_second is not None:
            series.output_rate.observe(job.output_tokens_per_second)
        finished = series.finished.get(job.status)
        if finished is None:
            finished = series.finished[job.status] = self.finished.labels(job.model, job.status)
        finished.inc()
        if job.prompt_tokens:
            series.prompt_tokens.inc(job.prompt_tokens)
        if job.completion_tokens:
            series.generation_tokens.inc(job.completion_tokens)

    def _series_of(self, model: str) -> _Series:
        """A model's children, looked up once: prometheus_client's `labels()` takes a lock
        and builds its key on every call, and six calls were 6 of a job's 10 µs here, for
        every job and batch line. (A race between two threads finds the same children.)"""
        series = _Series(
            queue_wait=self.queue_wait.labels(model),
            ttft=self.ttft.labels(model),
            inter_token=self.inter_token.labels(model),
            e2e=self.e2e.labels(model),
            output_rate=self.output_rate.labels(model),
            prompt_tokens=self.prompt_tokens.labels(model),
            generation_tokens=self.generation_tokens.labels(model),
            finished={},
        )
        self._series[model] = series
        return series

    def _now(self) -> Iterable[Metric]:
        s = self._state
        running = GaugeMetricFamily(
            "llmq_worker_running_jobs", "Jobs this worker is running now.", labels=["model"]
        )
        running.add_metric([s.model], float(s.running()))
        slots = GaugeMetricFamily(
            "llmq_worker_slots", "Jobs this worker runs at once at most.", labels=["model"]
        )
        slots.add_metric([s.model], float(s.slots))
        families: list[Metric] = [
            running,
            slots,
            build_info("worker", engine=s.engine, engine_version=s.engine_version, model=s.model),
        ]
        if s.energy is not None:
            energy = CounterMetricFamily(
                "llmq_device_energy_joules",
                "Energy drawn by each device (board power from NVML, integrated) since this worker started.",
                labels=["device"],
            )
            for device, joules in sorted(s.energy().items()):
                energy.add_metric([device], joules)
            families.append(energy)
        return families

    def exposition(self) -> bytes:
        """This worker's figures and the default registry's (vLLM's, the process's)."""
        return generate_latest(Collectors([self.registry, REGISTRY]))


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes come every few seconds: not logged."""


class MetricsServer:
    """The worker's `/metrics` HTTP port, on a daemon thread. Always the text format
    (0.0.4), as the API's: prometheus_client's OpenMetrics writer would rename vLLM's
    `vllm:` metrics to `vllm_` for a Prometheus that asks for OpenMetrics."""

    def __init__(self, metrics: WorkerMetrics, *, port: int, address: str) -> None:
        self._metrics = metrics
        self._port = port
        self._address = address
        self._server: WSGIServer | None = None

    @property
    def port(self) -> int | None:
        """The port it listens on (the system's pick for port 0); None until started."""
        return int(self._server.server_port) if self._server is not None else None

    def _app(self, environ: WSGIEnvironment, start_response: StartResponse) -> list[bytes]:
        if environ.get("PATH_INFO") != "/metrics":
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"not found: the metrics are at /metrics\n"]
        body = self._metrics.exposition()
        start_response("200 OK", [("Content-Type", CONTENT_TYPE), ("Content-Length", str(len(body)))])
        return [body]

    def start(self) -> int:
        server = make_server(self._address, self._port, self._app, _Server, handler_class=_Quiet)
        threading.Thread(target=_serve, args=(server,), name="llmq-metrics", daemon=True).start()
        self._server = server
        return self.port or 0

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def _serve(server: WSGIServer) -> None:
    name_native_thread()
    server.serve_forever()
