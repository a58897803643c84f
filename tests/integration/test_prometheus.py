"""A real Prometheus (Debian's, installed by scripts/test-deps.sh) scrapes a running stack:
two API replicas under gunicorn (two processes each) and the vLLM worker's own /metrics
port, every second. The test runs jobs, then asks Prometheus through its HTTP API:

- `histogram_quantile(0.5, ...)` of time to first token, end-to-end time and queue wait
  over the run is within one bucket of the median of the timings stored on the jobs;
- the generated-token counter grew by exactly the completion tokens of the jobs, and
  `rate()` over the run agrees with it;
- the API's request counter saw every submit, whichever gunicorn process answered it
  (prometheus_client's multiprocess mode);
- `sum()` of the queued-jobs figure over both replicas is the real queue, not twice it.

`promtool check metrics` passes on each exposition (vLLM's own `vllm:` names, which its lint
rejects for the colon, taken out first)."""

from __future__ import annotations

import bisect
import secrets
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from app.cli.embedded import free_port
from app.services.health import live_workers
from tests.helpers import ApiProcess, Stack, auth, run_many
from worker.metrics import E2E_BUCKETS, QUEUE_BUCKETS, TTFT_BUCKETS

pytestmark = pytest.mark.integration

SCRAPE_SECONDS = 1
# `rate()` extrapolates the first and last samples of its window to the window's edges, up to
# a scrape interval each: over this many seconds that is within 10 %.
RATE_WINDOW_SECONDS = 20


@dataclass
class Prometheus:
    url: str
    api_targets: list[str]
    worker_target: str
    started: float  # unix seconds

    def query(self, promql: str, at: float | None = None) -> list[dict[str, Any]]:
        params = {"query": promql, **({"time": f"{at:.3f}"} if at is not None else {})}
        r = httpx.get(f"{self.url}/api/v1/query", params=params, timeout=10)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["status"] == "success", body
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def scalar(self, promql: str, at: float | None = None) -> float:
        result = self.query(promql, at)
        assert len(result) == 1, (promql, result)
        return float(result[0]["value"][1])

    def wait_scraped(self, after: float, timeout: float = 30) -> None:
        """Until every target has been scraped, successfully, after `after` (unix seconds)."""
        deadline = time.monotonic() + timeout
        while True:
            targets = httpx.get(f"{self.url}/api/v1/targets", timeout=10).json()["data"]["activeTargets"]
            fresh = [
                t for t in targets if t["health"] == "up" and _unix(t["lastScrape"]) > after + SCRAPE_SECONDS
            ]
            if len(fresh) == len(self.api_targets) + 1:
                return
            assert time.monotonic() < deadline, targets
            time.sleep(0.3)


def _unix(rfc3339: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(rfc3339.replace("Z", "+00:00")).timestamp()


def worker_metrics_port(stack: Stack) -> int:
    assert stack.worker.proc is not None
    mine = f"llmq-{stack.worker.proc.pid}@"
    r = redis.Redis.from_url(stack.env["LLMQ_REDIS_URL"])
    (entry,) = [w for w in live_workers(r) if str(w.get("name", "")).startswith(mine)]
    port = entry.get("metrics_port")
    assert isinstance(port, int) and port > 0, entry
    return port


@pytest.fixture(scope="module")
def parked() -> str:
    """A declared model no worker serves: its jobs stay queued."""
    return f"parked-{secrets.token_hex(3)}"


@pytest.fixture(scope="module")
def second_api(stack: Stack, logs_dir: Path, parked: str) -> Iterator[ApiProcess]:
    api = ApiProcess({**stack.env, "LLMQ_MODELS": parked}, logs_dir / "api-second.log")
    yield api
    api.stop()


@pytest.fixture(scope="module")
def prometheus(stack: Stack, second_api: ApiProcess, logs_dir: Path) -> Iterator[Prometheus]:
    binary = shutil.which("prometheus")
    assert binary is not None, "Debian's prometheus is missing: run scripts/test-deps.sh"
    work = Path(tempfile.mkdtemp(prefix="llmq-prometheus-"))
    api_targets = [stack.url.removeprefix("http://"), second_api.url.removeprefix("http://")]
    worker_target = f"127.0.0.1:{worker_metrics_port(stack)}"
    config = work / "prometheus.yml"
    config.write_text(
        f"""
global:
  scrape_interval: {SCRAPE_SECONDS}s
  scrape_timeout: {SCRAPE_SECONDS}s
scrape_configs:
  - job_name: llmq-api
    static_configs: [{{targets: {api_targets}}}]
  - job_name: llmq-worker
    static_configs: [{{targets: ["{worker_target}"]}}]
"""
    )
    port = free_port(19090)
    log = open(logs_dir / "prometheus.log", "ab")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={work / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{url}/-/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "prometheus did not start"
            time.sleep(0.2)
        prom = Prometheus(url, api_targets, worker_target, time.time())
        prom.wait_scraped(time.time())
        yield prom
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
        shutil.rmtree(work, ignore_errors=True)


def bucket_index(buckets: tuple[float, ...], value: float) -> int:
    return bisect.bisect_left(buckets, value)


def test_prometheus_answers_match_the_jobs_that_ran(stack: Stack, prometheus: Prometheus) -> None:
    api_a = prometheus.api_targets[0]
    model = f'model="{stack.model}"'
    t0 = time.time()
    prometheus.wait_scraped(t0)  # the baseline every difference below starts from
    t0 = time.time()
    bodies = [
        {
            "model": stack.model,
            "messages": [{"role": "user", "content": f"Count to {i}, then say something else."}],
            "max_tokens": 8 + i % 5,
        }
        for i in range(16)
    ]
    jobs = run_many(stack, bodies)
    assert all(j["status"] == "succeeded" for j in jobs), [j["error"] for j in jobs]
    # Scraped for a whole rate window by then (the jobs may take less).
    time.sleep(max(0.1, prometheus.started + RATE_WINDOW_SECONDS + 2 - time.time()))
    prometheus.wait_scraped(time.time())
    t1 = time.time()

    for metric, field, buckets in (
        ("llmq_job_time_to_first_token_seconds", "ttft_seconds", TTFT_BUCKETS),
        ("llmq_job_end_to_end_seconds", "e2e_seconds", E2E_BUCKETS),
        ("llmq_job_queue_wait_seconds", "queue_wait_seconds", QUEUE_BUCKETS),
    ):
        stored = [float(j[field]) for j in jobs]
        series = f"{metric}_bucket{{{model}}}"
        estimate = prometheus.scalar(
            f"histogram_quantile(0.5, sum by (le) ({series} - {series} @ {t0:.3f}))", at=t1
        )
        median = statistics.median(stored)
        assert abs(bucket_index(buckets, estimate) - bucket_index(buckets, median)) <= 1, (
            metric,
            estimate,
            median,
            stored,
        )
        count = f"{metric}_count{{{model}}}"
        assert prometheus.scalar(f"sum({count}) - sum({count} @ {t0:.3f})", at=t1) == len(jobs)
    for job in jobs:
        assert 0 < job["ttft_seconds"] <= job["e2e_seconds"]
        assert 0 <= job["queue_wait_seconds"] <= job["e2e_seconds"]

    tokens = sum(j["usage"]["completion_tokens"] for j in jobs)
    counter = f"llmq_generation_tokens_total{{{model}}}"
    assert prometheus.scalar(f"sum({counter}) - sum({counter} @ {t0:.3f})", at=t1) == tokens
    window = max(RATE_WINDOW_SECONDS, int(t1 - t0) + 2)
    rate = prometheus.scalar(f"sum(rate({counter}[{window}s]))", at=t1)
    assert rate * window == pytest.approx(tokens, rel=0.15), (rate, window, tokens)
    done = f'llmq_jobs_finished_total{{{model},status="succeeded"}}'
    assert prometheus.scalar(f"sum({done}) - sum({done} @ {t0:.3f})", at=t1) == len(jobs)

    # Every submit to replica A counted, whichever of its gunicorn processes took it.
    posts = f'llmq_http_requests_total{{instance="{api_a}",route="/v2/jobs",method="POST",status="202"}}'
    assert prometheus.scalar(f"sum({posts}) - sum({posts} @ {t0:.3f} or vector(0))", at=t1) == len(jobs)
    submitted = f'llmq_jobs_submitted_total{{instance="{api_a}",{model},kind="single"}}'
    assert prometheus.scalar(f"sum({submitted}) - sum({submitted} @ {t0:.3f} or vector(0))", at=t1) == len(
        jobs
    )

    # vLLM's own metrics are on, and scraped from the worker's port.
    assert prometheus.query(f'vllm:num_requests_running{{instance="{prometheus.worker_target}"}}', at=t1)
    assert prometheus.scalar(f'sum(llmq_build_info{{instance="{prometheus.worker_target}"}})', at=t1) == 1


def test_two_replicas_sum_to_the_real_queue(
    stack: Stack, second_api: ApiProcess, prometheus: Prometheus, parked: str
) -> None:
    with httpx.Client(base_url=second_api.url, headers=auth(stack.key), timeout=30) as b:
        body = {"model": parked, "messages": [{"role": "user", "content": "wait"}]}
        ids = [b.post("/v2/jobs", json=body).json()["id"] for _ in range(5)]
        try:
            prometheus.wait_scraped(time.time())
            series = f'llmq_model_queued_jobs{{model="{parked}"}}'
            assert prometheus.scalar(f"sum({series})") == len(ids)
            assert prometheus.scalar(f"count({series})") == 1  # sent by one replica
            assert prometheus.scalar("sum(llmq_cluster_reporter)") == 1
            assert prometheus.scalar("count(llmq_cluster_reporter)") == 2  # both replicas scraped
            queued = f'llmq_jobs_active{{model="{parked}",status="queued"}}'
            assert prometheus.scalar(f"sum({queued})") == len(ids)
        finally:
            for job_id in ids:
                assert b.post(f"/v2/jobs/{job_id}/cancel").status_code == 200


def test_readiness_lists_each_workers_metrics_port(stack: Stack, prometheus: Prometheus) -> None:
    ready = httpx.get(f"{stack.url}/readyz", headers=auth(stack.key), timeout=10).json()
    ports = [w.get("metrics_port") for w in ready["checks"]["workers"]["workers"]]
    assert int(prometheus.worker_target.rsplit(":", 1)[1]) in ports


def test_promtool_passes_every_exposition(stack: Stack, prometheus: Prometheus) -> None:
    targets = [*prometheus.api_targets, prometheus.worker_target]
    for target in targets:
        text = httpx.get(f"http://{target}/metrics", timeout=10).text
        assert "llmq_build_info" in text
        vllm = [line for line in text.splitlines() if "vllm:" in line]
        if target == prometheus.worker_target:
            assert vllm, "the worker sends vLLM's own metrics"
        ours = "\n".join(line for line in text.splitlines() if "vllm:" not in line) + "\n"
        done = subprocess.run(
            ["promtool", "check", "metrics"], input=ours, capture_output=True, text=True, check=False
        )
        assert done.returncode == 0 and not (done.stdout + done.stderr).strip(), (
            target,
            done.stdout,
            done.stderr,
        )
