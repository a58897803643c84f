"""B3 submit rate and B6 poll latency, against a hello-world JSON endpoint served by the
same gunicorn setup (bench/hello.py; app/serve.py's argv, same worker count) in the same run.

B3: closed-loop clients POST /v2/jobs (auth, validation, insert, enqueue; the instant engine
drains the queue as `llmq up` would) at 1, 2, 4, ... concurrent connections; the sustained
rate is the best rate whose p99 stays under 50 ms. The same for POST /hello. Goal: ≥ 0.5.
B6: at that concurrency, one more client polls GET /v2/jobs/<id> while the POSTs run, and
likewise GET /hello under the hello-world load. Goal: llmq's p99 ≤ 2× hello-world's.
CPU ms per submitted job by process comes from /proc (bench/cpu.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from typing import Any

import httpx

from app.cli.embedded import free_port
from app.serve import gunicorn_argv
from bench import cpu, load
from bench.common import ROOT, save, service

SERVED = "bench-b3"
P99_LIMIT_S = 0.050
HELLO_APP = "bench.hello:create_app()"


def start_hello(workers: int) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port(18990)
    proc = subprocess.Popen(
        gunicorn_argv("127.0.0.1", port, workers=workers, app=HELLO_APP),
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/hello", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("hello-world server did not start")


def sustained(curve: list[dict[str, Any]]) -> dict[str, Any]:
    """The best rate of `curve` whose p99 is under the limit (the lowest level if none is)."""
    ok = [point for point in curve if point["p99_ms"] < P99_LIMIT_S * 1e3 and not point["errors"]]
    return max(ok, key=lambda point: point["rps"]) if ok else min(curve, key=lambda point: point["clients"])


def under_load(
    post: Any, poll: Any, clients: int, seconds: float
) -> tuple[dict[str, float], dict[str, float]]:
    """`clients` closed loops of `post`, and one of `poll` beside them: both summaries."""
    polled: list[load.Load] = []
    poller = threading.Thread(target=lambda: polled.append(load.run(poll, 1, seconds)), daemon=True)
    poller.start()
    posted = load.run(post, clients, seconds)
    poller.join()
    return posted.summary(), polled[0].summary()


def run(levels: tuple[int, ...] = (1, 2, 4, 8, 16, 32), seconds: float = 5.0) -> dict[str, Any]:
    env = {
        "LLMQ_ENGINE": "instant",
        # The per-key limiter still runs (as for a tenant whose limit was raised); the
        # per-tenant cap on active jobs stays at its default.
        "LLMQ_RATE_LIMIT_PER_MINUTE": "100000000",
    }
    body = {"model": SERVED, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 16}
    with service("instant", SERVED, **env) as stack:
        auth = {"Authorization": f"Bearer {stack.api_key}"}
        post_job = load.request_fn(stack.base_url, "POST", "/v2/jobs", body, auth)
        job_id = httpx.post(f"{stack.base_url}/v2/jobs", json=body, headers=auth).json()["id"]
        get_job = load.request_fn(stack.base_url, "GET", f"/v2/jobs/{job_id}", None, auth)
        hello, hello_url = start_hello(stack.settings.api_workers)
        try:
            post_hello = load.request_fn(hello_url, "POST", "/hello", body)
            get_hello = load.request_fn(hello_url, "GET", "/hello")
            curves: dict[str, list[dict[str, Any]]] = {"llmq": [], "hello": []}
            for clients in levels:
                with cpu.measure(stack) as use:
                    point = load.run(post_job, clients, seconds)
                curves["llmq"].append(
                    {
                        "clients": clients,
                        **point.summary(),
                        "cpu_ms_per_job": use.per_unit_ms(len(point.latencies)),
                    }
                )
                curves["hello"].append(
                    {"clients": clients, **load.run(post_hello, clients, seconds).summary()}
                )
            best, best_hello = sustained(curves["llmq"]), sustained(curves["hello"])
            level = best["clients"]
            _, poll_llmq = under_load(post_job, get_job, level, seconds)
            _, poll_hello = under_load(post_hello, get_hello, level, seconds)
        finally:
            hello.send_signal(signal.SIGINT)
            hello.wait(30)
    b3 = {
        "id": "B3",
        "llmq_rps": best["rps"],
        "hello_rps": best_hello["rps"],
        "ratio": round(best["rps"] / best_hello["rps"], 3),
        "llmq_p99_ms": best["p99_ms"],
        "cpu_ms_per_job": best["cpu_ms_per_job"],
        "curves": curves,
        "goal": ">= 0.5 of hello-world at p99 < 50 ms",
    }
    b6 = {
        "id": "B6",
        "clients": level,
        "get_job_p99_ms": poll_llmq["p99_ms"],
        "hello_p99_ms": poll_hello["p99_ms"],
        "ratio": round(poll_llmq["p99_ms"] / poll_hello["p99_ms"], 3),
        "goal": "<= 2x hello-world p99",
    }
    save("b3", b3)
    save("b6", b6)
    return {"B3": b3, "B6": b6}
