"""B1 engine efficiency: output tokens/s of N chat requests through the whole service
(API → Redis → worker → vLLM → Postgres) against the same requests through AsyncLLM directly.
Goal: ratio ≥ 0.95."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from typing import Any

from bench import cpu
from bench.common import ROOT, save, service, submit_all, wait_done


def bodies(n: int, max_tokens: int, served: str) -> list[dict[str, Any]]:
    return [
        {
            "model": served,
            "messages": [{"role": "user", "content": f"Request {i}: tell me about queues."}],
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0,
        }
        for i in range(n)
    ]


def run(model: str, n: int = 64, max_tokens: int = 256) -> dict[str, Any]:
    served = "bench-b1"
    reqs = bodies(n, max_tokens, served)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(reqs, f)
    direct_out = (
        subprocess.run(
            [sys.executable, "-m", "bench.b1_direct", "--model", model, "--bodies", f.name],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    direct = json.loads(direct_out)
    with service(model, served) as stack:
        # Warm-up, not measured: each API process loads the model's tokenizer on its first
        # request (seconds of CPU), and the engine compiles on its first steps.
        warm = bodies(4 * stack.settings.api_workers, 1, served)
        wait_done(stack, submit_all(stack, warm))
        with cpu.measure(stack) as use:
            ids = submit_all(stack, reqs)
            svc = wait_done(stack, ids)
    direct_tps = direct["tokens"] / direct["seconds"]
    service_tps = svc["tokens"] / svc["wall"]
    result = {
        "id": "B1",
        "requests": n,
        "max_tokens": max_tokens,
        "direct_tokens_per_s": round(direct_tps, 1),
        "service_tokens_per_s": round(service_tps, 1),
        "ratio": round(service_tps / direct_tps, 3),
        "cpu_ms_per_job": use.per_unit_ms(n),
        # The bare AsyncLLM client's own process (engine core excluded), per request: what
        # the worker's process is held against (goal: worker <= 1.5x this).
        "direct_client_cpu_ms_per_job": round(direct["client_cpu_seconds"] * 1e3 / n, 3),
        "worker_vs_direct_client": round(use.seconds["worker"] / max(direct["client_cpu_seconds"], 1e-9), 2),
        "goal": ">= 0.95",
    }
    save("b1", result)
    return result
