"""The metric definitions: what a worker observes per ended job (the same figures its
records hold), Prometheus's naming conventions (checked by Debian's promtool too), the
cluster figures sent by one lease holder only, and the dashboard's and Prometheus config's
agreement with the names the code defines."""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fakeredis
import pytest
from prometheus_client import generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from app.liveness import Liveness
from app.metrics import ApiMetrics, Collectors, Computed, build_info
from app.services.metrics import LEASE_KEY, ClusterLease, MetricsService
from tests.helpers import ROOT
from tests.unit.fakes import FakeStore, FakeStreams, fake_runner
from worker.engine import InstantEngine
from worker.loop import LoopThread
from worker.metrics import JobFigures, WorkerMetrics, WorkerState

OBSERVABILITY = ROOT / "deploy" / "observability"
DASHBOARD = OBSERVABILITY / "grafana" / "dashboards" / "llmq.json"


class _NoDatabase:
    """A Database whose every session fails: the scrape reports `llmq_database_up 0`."""

    def session(self) -> Any:
        raise ConnectionError("no database in the unit tier")


def worker_metrics(*, energy: bool = False) -> WorkerMetrics:
    return WorkerMetrics(
        WorkerState(
            model="m",
            engine="instant",
            engine_version="0",
            running=lambda: 2,
            slots=8,
            energy=(lambda: {"GPU-0": 12.5}) if energy else None,
        )
    )


def cluster(redis: fakeredis.FakeRedis, owner: str, lease_seconds: float = 30.0) -> MetricsService:
    return MetricsService(
        _NoDatabase(),  # type: ignore[arg-type]
        redis,
        Liveness(redis, marker_ttl_seconds=60),
        lambda: frozenset({"m"}),
        ClusterLease(redis, owner, lease_seconds=lease_seconds),
    )


def families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(text: str, name: str, **labels: str) -> float | None:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return None


@pytest.fixture
def loop() -> Iterator[LoopThread]:
    lt = LoopThread()
    lt.start()
    yield lt
    lt.stop()


def test_each_ended_job_is_observed_once_with_the_figures_its_record_holds(loop: LoopThread) -> None:
    metrics = worker_metrics()
    store, streams = FakeStore(), FakeStreams()
    for i in range(3):
        store.add(f"ok_{i}", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    store.add("too_long", {"model": "m", "messages": [{"role": "user", "content": "x" * 200}]})
    runner = fake_runner(
        store, loop, engine=InstantEngine(context=100, delay=0.002), streams=streams, observe=metrics.observe
    )
    statuses = runner.run_many([*(f"ok_{i}" for i in range(3)), "too_long"])
    assert statuses == {"ok_0": "succeeded", "ok_1": "succeeded", "ok_2": "succeeded", "too_long": "failed"}
    text = generate_latest(metrics.registry).decode()
    jobs = store.jobs
    ok = [jobs[f"ok_{i}"] for i in range(3)]
    assert value(text, "llmq_jobs_finished_total", model="m", status="succeeded") == 3
    assert value(text, "llmq_jobs_finished_total", model="m", status="failed") == 1
    assert value(text, "llmq_generation_tokens_total", model="m") == sum(
        j["usage"]["completion_tokens"] for j in ok
    )
    assert value(text, "llmq_prompt_tokens_total", model="m") == sum(j["usage"]["prompt_tokens"] for j in ok)
    # Every ended job has a queue wait and an end-to-end time; only those with a token a TTFT.
    assert value(text, "llmq_job_end_to_end_seconds_count", model="m") == 4
    assert value(text, "llmq_job_queue_wait_seconds_count", model="m") == 4
    assert value(text, "llmq_job_time_to_first_token_seconds_count", model="m") == 3
    assert jobs["too_long"]["ttft_seconds"] is None and jobs["too_long"]["e2e_seconds"] > 0
    ttft_sum = value(text, "llmq_job_time_to_first_token_seconds_sum", model="m")
    assert ttft_sum == pytest.approx(sum(j["ttft_seconds"] for j in ok), abs=1e-9)
    e2e_sum = value(text, "llmq_job_end_to_end_seconds_sum", model="m")
    assert e2e_sum == pytest.approx(sum(j["e2e_seconds"] for j in jobs.values()), abs=1e-9)
    for job in ok:
        assert 0 < job["ttft_seconds"] <= job["e2e_seconds"]
        assert job["e2e_seconds"] >= job["queue_wait_seconds"] >= 0
    # Four tokens each: three inter-token gaps per job, and a rate of one over the mean gap.
    assert value(text, "llmq_job_inter_token_seconds_count", model="m") == 3
    assert value(text, "llmq_job_output_tokens_per_second_count", model="m") == 3
    # A second delivery of an ended job is not a second observation.
    assert runner.run("ok_0") is None
    again = generate_latest(metrics.registry).decode()
    assert value(again, "llmq_job_end_to_end_seconds_count", model="m") == 4


def test_the_served_model_series_exist_before_the_first_job() -> None:
    text = generate_latest(worker_metrics().registry).decode()
    assert value(text, "llmq_generation_tokens_total", model="m") == 0
    assert value(text, "llmq_job_time_to_first_token_seconds_count", model="m") == 0
    assert value(text, "llmq_worker_running_jobs", model="m") == 2
    assert value(text, "llmq_worker_slots", model="m") == 8
    assert value(text, "llmq_build_info", component="worker", engine="instant", model="m") == 1


def test_energy_is_exposed_only_where_a_sensor_exists() -> None:
    assert "llmq_device_energy_joules" not in generate_latest(worker_metrics().registry).decode()
    text = generate_latest(worker_metrics(energy=True).registry).decode()
    assert value(text, "llmq_device_energy_joules_total", device="GPU-0") == 12.5


def test_each_request_counts_in_its_own_series() -> None:
    """The API's request series, their children looked up once per label values: each
    observation lands in its route, method and status; a method outside the known set
    counts as `other`, however many such names arrive."""
    api = ApiMetrics()
    for method in ("GET", "GET", "POST", "BREW", "SPAM"):
        api.observe_request("/v2/jobs/<job_id>", method, 200, 0.01)
    api.observe_request(None, "GET", 404, 0.02)
    api.count_submitted("m", "single")
    api.count_submitted("m", "batch_line", 3)
    api.count_submitted("m", "single")
    text = generate_latest(api.registry).decode()
    route = "/v2/jobs/<job_id>"
    assert value(text, "llmq_http_requests_total", route=route, method="GET", status="200") == 2
    assert value(text, "llmq_http_requests_total", route=route, method="POST", status="200") == 1
    assert value(text, "llmq_http_requests_total", route=route, method="other", status="200") == 2
    assert value(text, "llmq_http_requests_total", route="unmatched", method="GET", status="404") == 1
    duration = "llmq_http_request_duration_seconds"
    assert value(text, f"{duration}_count", route=route, method="other", status="200") == 2
    assert value(text, f"{duration}_sum", route="unmatched", method="GET", status="404") == 0.02
    assert value(text, "llmq_jobs_submitted_total", model="m", kind="single") == 2
    assert value(text, "llmq_jobs_submitted_total", model="m", kind="batch_line") == 3
    assert len(api._requests) == 4


def _expositions() -> list[str]:
    """Everything llmq itself defines, with a sample in each labelled family: what an API
    replica holding the cluster lease sends (with and without worker details), and a worker."""
    api = ApiMetrics()
    api.observe_request("/v2/jobs/<job_id>", "GET", 200, 0.01)
    api.count_submitted("m", "single")
    worker = worker_metrics(energy=True)
    worker.observe(
        JobFigures(
            model="m",
            status="succeeded",
            queue_wait_seconds=0.5,
            ttft_seconds=0.05,
            inter_token_seconds=0.01,
            e2e_seconds=1.0,
            output_tokens_per_second=100.0,
            prompt_tokens=10,
            completion_tokens=20,
        )
    )
    redis = fakeredis.FakeRedis()
    redis.set("llmq:worker:w1", json.dumps({"name": "w1", "model": "m", "consuming": True}))
    redis.zadd("llmq:workers", {"w1": time.time()})
    holder = cluster(redis, "replica-a")
    out = []
    for details in (True, False):
        figures: list[Metric] = list(holder.collect(details=details))
        parts = [api.registry, Computed(lambda: [build_info("api")]), Computed(lambda f=figures: f)]  # type: ignore[misc]
        out.append(generate_latest(Collectors(parts)).decode())
    out.append(generate_latest(worker.registry).decode())
    return out


def defined_names() -> set[str]:
    """Sample names the code can expose (a family's name and its series' names)."""
    names: set[str] = set()
    for text in _expositions():
        for family in text_string_to_metric_families(text):
            names.add(family.name)
            names.update(sample.name for sample in family.samples)
    return names


def test_names_follow_prometheus_conventions() -> None:
    families = [f for text in _expositions() for f in text_string_to_metric_families(text)]
    for family in families:
        assert family.name.startswith("llmq_"), family.name
        assert family.documentation, family.name
        if family.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in family.samples), family.name
        elif family.type == "histogram":
            assert family.name.endswith(("_seconds", "_per_second")), family.name
        else:
            assert not family.name.endswith("_total"), family.name


def test_promtool_lints_every_exposition_clean() -> None:
    for text in _expositions():
        done = subprocess.run(
            ["promtool", "check", "metrics"], input=text, capture_output=True, text=True, check=False
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert not (done.stdout + done.stderr).strip(), done.stdout + done.stderr


def test_cluster_figures_come_from_the_lease_holder_alone() -> None:
    redis = fakeredis.FakeRedis()
    a, b = cluster(redis, "replica-a", lease_seconds=0.3), cluster(redis, "replica-b", lease_seconds=0.3)

    def scrape(service: MetricsService) -> str:
        return generate_latest(Computed(lambda: list(service.collect()))).decode()

    first, second = scrape(a), scrape(b)
    assert value(first, "llmq_cluster_reporter") == 1 and value(second, "llmq_cluster_reporter") == 0
    assert "llmq_queue_depth" in families(first) and set(families(second)) == {"llmq_cluster_reporter"}
    assert value(first, "llmq_database_up") == 0  # the outage is reported, the scrape still answers
    # The holder's scrapes renew its lease: the other never takes it meanwhile.
    for _ in range(4):
        time.sleep(0.1)
        assert value(scrape(a), "llmq_cluster_reporter") == 1
        assert value(scrape(b), "llmq_cluster_reporter") == 0
    # Once the holder stops being scraped, its lease lapses and the other takes over.
    time.sleep(0.4)
    assert value(scrape(b), "llmq_cluster_reporter") == 1
    assert value(scrape(a), "llmq_cluster_reporter") == 0
    assert redis.get(LEASE_KEY) == b"replica-b"


def test_no_replica_reports_when_redis_does_not_answer() -> None:
    server = fakeredis.FakeServer()
    service = cluster(fakeredis.FakeRedis(server=server), "replica-a")
    server.connected = False
    text = generate_latest(Computed(lambda: list(service.collect()))).decode()
    assert value(text, "llmq_cluster_reporter") == 0 and set(families(text)) == {"llmq_cluster_reporter"}


def _dashboard_exprs() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in board["panels"] for t in panel.get("targets", [])]
    exprs += [v["query"]["query"] for v in board["templating"]["list"] if v["type"] == "query"]
    return exprs


def _vllm_names() -> set[str]:
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None
    source = (Path(spec.origin).parent / "v1" / "metrics" / "loggers.py").read_text()
    return set(re.findall(r'"(vllm:[a-z_:]+)"', source))


def test_the_dashboard_uses_only_metric_names_the_code_defines() -> None:
    exprs = _dashboard_exprs()
    assert len(exprs) >= 10
    llmq = defined_names()
    vllm = _vllm_names()
    used = set()
    for expr in exprs:
        for name in re.findall(r"\b(llmq_[a-z0-9_]+)", expr):
            used.add(name)
            assert name in llmq, (name, expr)
        for name in re.findall(r"(vllm:[a-z_:]+)", expr):
            base = re.sub(r"_(bucket|sum|count|total)$", "", name)
            assert name in vllm or base in vllm, (name, expr)
    # The panels the issue asks for.
    for wanted in (
        "llmq_model_queued_jobs",
        "llmq_job_queue_wait_seconds_bucket",
        "llmq_job_time_to_first_token_seconds_bucket",
        "llmq_job_end_to_end_seconds_bucket",
        "llmq_generation_tokens_total",
        "llmq_jobs_active",
        "llmq_worker_running_jobs",
        "llmq_jobs_finished_total",
    ):
        assert wanted in used, wanted


def test_the_prometheus_config_is_valid() -> None:
    done = subprocess.run(
        ["promtool", "check", "config", "--syntax-only", str(OBSERVABILITY / "prometheus.yml")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_worker_port_serves_the_text_format_with_vllms_names_kept() -> None:
    """vLLM records into the default registry; a Prometheus asking for OpenMetrics still gets
    the text format, where `vllm:` names keep their colon."""
    import httpx
    from prometheus_client import REGISTRY, Gauge

    from worker.metrics import MetricsServer

    gauge = Gauge("vllm:unit_test_requests_running", "A stand-in for vLLM's gauges.", registry=REGISTRY)
    server = MetricsServer(worker_metrics(), port=0, address="127.0.0.1")
    try:
        port = server.start()
        assert port > 0 and server.port == port
        accept = {"Accept": "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"}
        r = httpx.get(f"http://127.0.0.1:{port}/metrics", headers=accept, timeout=5)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
        assert "vllm:unit_test_requests_running 0.0" in r.text
        assert 'llmq_build_info{component="worker"' in r.text
        assert httpx.get(f"http://127.0.0.1:{port}/other", timeout=5).status_code == 404
    finally:
        server.stop()
        REGISTRY.unregister(gauge)
    assert server.port is None
