"""B5 stream overhead: what an SSE client sees against what the engine produced.

For 1, 16 and 64 concurrent streams (`stream: true` on /v1/chat/completions, tiny model):
- time to first chunk against the baseline the issue names: the same requests through
  vLLM's AsyncLLM directly, at the same concurrency, in the same run (bench/b5_direct.py);
  added = the client's p99 − the direct caller's p99 time to first token. Each level runs
  `load.rounds` times one after the other on both sides (100 rounds of one stream, 7 of 16,
  3 of 64), so that a p99 is read from 100 requests or more: from fewer it is the slowest
  request (`load.pct` of 32 values at 99 is the 32nd), one hiccup of the machine's;
- added time to first chunk per job = a client's time to first chunk − that job's own
  engine time to first token (from its generation stats), so it holds API, queue, claim
  and delivery whatever the engine did;
- delivery lag = when a chunk reached the client − when the worker produced it (each event
  carries the worker's production time `t`, persisted with the job);
- inter-chunk gap at the client against the gap between productions in the worker, and the
  direct caller's inter-token gap;
- the first chunk's time by stage (`figures`): API, queue (commit, broker, task), worker
  (claim, rendering, engine admission), the engine's own time to first token, delivery;
  p50 and p99 of each, so that what llmq adds is read where it is spent.
The client is bench/sse.py's (asyncio streams, connections opened before the requests are
timed): httpx's cost the load generator 5.7 ms of CPU a stream at 64, on the service's cores.
Goal: p99 added ≤ 20 ms. Also: 1,000 idle streams held open by one API, with its thread
count and memory (gevent workers: a greenlet per stream, not a thread).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
from collections.abc import Mapping
from typing import Any

import httpx
import psutil
from sqlalchemy import text

from app.connections import ADMIN_POOL
from app.db import Database
from bench import cpu
from bench.common import save, script_json, service, submit_all, wait_done
from bench.load import no_collections, pct, rounds
from bench.sse import Connection

PROMPT = "stream please"
# Requests a level's p99 is read from, at least (bench/load.py's `rounds`, on both sides):
# the fewest whose p99 is not their maximum (of 100, the 99th).
SAMPLES = 100


def direct_run(model: str, levels: tuple[int, ...], max_tokens: int) -> dict[str, dict[str, float]]:
    """B5's requests through a bare AsyncLLM in a process of its own (bench/b5_direct.py)."""
    figures: dict[str, dict[str, float]] = script_json(
        "bench.b5_direct",
        *("--model", model, "--levels", ",".join(map(str, levels))),
        *("--max-tokens", str(max_tokens), "--content", PROMPT, "--samples", str(SAMPLES)),
    )
    return figures


async def one_stream(conn: Connection, model: str, max_tokens: int, key: str) -> dict[str, Any]:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    async with asyncio.timeout(300):
        got = await conn.post_stream("/v1/chat/completions", body, {"Authorization": f"Bearer {key}"})
    if got.status != 200 or "x-llmq-job-id" not in got.headers:
        raise RuntimeError(f"stream refused: HTTP {got.status}: {got.body[:500]!r}")
    return {"job_id": got.headers["x-llmq-job-id"], "sent": got.sent, "arrivals": got.arrivals}


def measure(results: list[dict[str, Any]], db: Database) -> dict[str, float]:
    ids = [r["job_id"] for r in results]
    with db.session() as s:
        rows = {
            r.id: r
            for r in s.execute(
                text(
                    "SELECT id, events, generation_stats, extract(epoch FROM created_at)::float8 AS created, "
                    "extract(epoch FROM started_at)::float8 AS started FROM jobs WHERE id = ANY(:ids)"
                ),
                {"ids": ids},
            )
        }
    return figures(results, rows)


# Where a stream's first chunk spends its time, in order (`figures`' `stages`).
STAGES = ("api", "queue", "worker", "engine", "delivery")


def figures(results: list[dict[str, Any]], rows: Mapping[str, Any]) -> dict[str, float]:
    """The level's figures from what each client saw (`results`: job id, when it was sent,
    each event's arrival) and each job's row (`events` with the worker's production time
    `t`, `generation_stats`, `created` and `started` as epoch seconds).

    The first chunk's time, cut where the job's own timestamps fall (p50 and p99 of each,
    `stage_<name>_p50_ms`): `api` from the request sent to the job made (the API's
    reading, checks and rate limits), `queue` from there to the worker's claim (the insert's
    commit, the broker message, the task), `worker` from the claim to the first chunk
    produced less the engine's own time to first token (rendering, the engine's queue, the
    first flush), `engine` that time to first token, `delivery` from production to the
    client (Redis, the API's relay, the socket)."""
    ttfc, added_ttfc, lag, client_gap, worker_gap = [], [], [], [], []
    stages: dict[str, list[float]] = {name: [] for name in STAGES}
    for result in results:
        row = rows[result["job_id"]]
        produced = {e["id"]: e["t"] for e in row.events if e.get("type") == "chunk"}
        stats = row.generation_stats
        engine_ttft = stats["prompt_tokens"] / stats["prompt_tps"] if stats["prompt_tps"] else 0.0
        chunks = [(eid, t) for eid, t in result["arrivals"] if eid in produced]
        if not chunks:
            continue
        ttfc.append((chunks[0][1] - result["sent"]) * 1e3)
        added_ttfc.append(ttfc[-1] - engine_ttft * 1e3)
        lag.extend((t - produced[eid]) * 1e3 for eid, t in chunks)
        client_gap.extend((b[1] - a[1]) * 1e3 for a, b in itertools.pairwise(chunks))
        worker_gap.extend((produced[b[0]] - produced[a[0]]) * 1e3 for a, b in itertools.pairwise(chunks))
        first = produced[chunks[0][0]]
        cuts = (result["sent"], row.created, row.started, first - engine_ttft, first, chunks[0][1])
        for name, (a, b) in zip(STAGES, itertools.pairwise(cuts), strict=True):
            stages[name].append((b - a) * 1e3)
    return {
        "ttfc_p50_ms": round(pct(ttfc, 50), 2),
        "ttfc_p99_ms": round(pct(ttfc, 99), 2),
        "added_ttfc_p50_ms": round(pct(added_ttfc, 50), 2),
        "added_ttfc_p99_ms": round(pct(added_ttfc, 99), 2),
        "delivery_lag_p50_ms": round(pct(lag, 50), 2),
        "delivery_lag_p99_ms": round(pct(lag, 99), 2),
        "client_gap_p50_ms": round(pct(client_gap, 50), 2),
        "worker_gap_p50_ms": round(pct(worker_gap, 50), 2),
        "gap_added_p99_ms": round(pct(client_gap, 99) - pct(worker_gap, 99), 2),
        **{f"stage_{name}_p{q}_ms": round(pct(v, q), 2) for name, v in stages.items() for q in (50, 99)},
    }


async def streams_at(url: str, key: str, model: str, n: int, max_tokens: int) -> list[dict[str, Any]]:
    """`n` streams at once, each on a connection opened before any is sent (bench/sse.py)."""
    conns = await asyncio.gather(*(Connection.open(url) for _ in range(n)))
    return list(await asyncio.gather(*(one_stream(c, model, max_tokens, key) for c in conns)))


async def idle_streams(url: str, key: str, model: str, n: int, api_pid: int) -> dict[str, Any]:
    """Open `n` streams on queued jobs (no worker runs them), hold them, and read the API's
    threads and memory while they are open."""
    # A connection idle past the API's keep-alive (gunicorn's, 2 s) is not reused: the
    # submits' connections wait while a thousand streams are opened, and one the server
    # closes as it is reused fails that stream's request (httpx retries only a connect).
    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8, keepalive_expiry=1.0)
    async with httpx.AsyncClient(
        base_url=url, headers={"Authorization": f"Bearer {key}"}, limits=limits, timeout=60
    ) as c:
        body = {"model": model, "messages": [{"role": "user", "content": "wait"}], "max_tokens": 4}
        # Submitted 32 at a time, as clients would: a thousand at once would find the API's
        # database pool busy (503) rather than measure idle streams.
        gate = asyncio.Semaphore(32)

        async def submit() -> str:
            async with gate:
                r = await c.post("/v2/jobs", json=body)
            if r.status_code != 202:
                raise RuntimeError(f"submit refused: HTTP {r.status_code}: {r.text[:300]}")
            return str(r.json()["id"])

        jobs = list(await asyncio.gather(*(submit() for _ in range(n))))
        streams = [c.stream("GET", f"/v2/jobs/{job_id}/stream") for job_id in jobs]
        responses = await asyncio.gather(*(cm.__aenter__() for cm in streams))
        opened = sum(r.status_code == 200 for r in responses)
        await asyncio.sleep(3)
        figures = api_figures(api_pid)
        for cm in streams:
            await cm.__aexit__(None, None, None)
        return {"opened": opened, **figures}


def api_figures(pid: int) -> dict[str, float]:
    proc = psutil.Process(pid)
    workers = proc.children()
    return {
        "api_threads": sum(w.num_threads() for w in workers),
        "api_rss_mb": round(sum(w.memory_info().rss for w in workers) / 2**20, 1),
    }


def run(
    model: str, levels: tuple[int, ...] = (1, 16, 64), max_tokens: int = 128, idle: int = 1000
) -> dict[str, Any]:
    served = "bench-b5"
    out: dict[str, Any] = {"id": "B5", "goal": "p99 added <= 20 ms"}
    # Before the service starts, so the two never share the machine.
    direct = out["direct"] = direct_run(model, levels, max_tokens)
    # One key holds every stream here (1,000 idle subscribers among them, each on a job of
    # its own): its cap on open streams (default 32) and its request burst (500) are raised
    # as an operator serving them would.
    streams_cap = str(max(levels) + idle + 16)
    burst = str(2 * (idle + sum(levels)) + 100)
    with service(model, served, LLMQ_MAX_STREAMS_PER_KEY=streams_cap, LLMQ_RATE_LIMIT_BURST=burst) as stack:
        db = Database.from_url(stack.env["LLMQ_DATABASE_URL"], ADMIN_POOL)
        # Warm-up: each API process loads the model's tokenizer on its first request (seconds
        # of CPU); concurrent submits reach every gunicorn worker before anything is measured.
        warm = {"model": served, "messages": [{"role": "user", "content": "warm"}], "max_tokens": 1}
        wait_done(stack, submit_all(stack, [warm] * (4 * stack.settings.api_workers)))
        asyncio.run(streams_at(stack.base_url, stack.api_key, served, 1, 8))
        for n in levels:
            results = []
            with cpu.measure(stack) as use:
                for _ in range(rounds(n, SAMPLES)):
                    with no_collections():
                        level = streams_at(stack.base_url, stack.api_key, served, n, max_tokens)
                        results += asyncio.run(level)
            figures = measure(results, db)
            base = direct[f"n{n}"]
            out[f"n{n}"] = {
                **figures,
                "direct_ttft_p99_ms": base["ttft_p99_ms"],
                "added_vs_direct_p99_ms": round(figures["ttfc_p99_ms"] - base["ttft_p99_ms"], 2),
                "direct_itl_p99_ms": base["itl_p99_ms"],
                "requests": len(results),
                "cpu_ms_per_job": use.per_unit_ms(len(results)),
            }
        db.dispose()
        worker = stack.procs["worker"]
        worker.terminate()
        worker.wait(60)
        out["idle_streams"] = {
            "at_rest": api_figures(stack.procs["api"].pid),
            "holding": asyncio.run(
                idle_streams(stack.base_url, stack.api_key, served, idle, stack.procs["api"].pid)
            ),
        }
    out["summary"] = {
        f"n{n}": (
            "TTFC p99 {ttfc_p99_ms} ms vs direct AsyncLLM {direct_ttft_p99_ms} ms "
            "(+{added_vs_direct_p99_ms}), per job +{added_ttfc_p99_ms} ms p99, "
            "delivery lag {delivery_lag_p99_ms} ms p99; first chunk p50 by stage: api "
            "{stage_api_p50_ms}, queue {stage_queue_p50_ms}, worker {stage_worker_p50_ms}, engine "
            "{stage_engine_p50_ms}, delivery {stage_delivery_p50_ms} ms"
        ).format(**out[f"n{n}"])
        for n in levels
    }
    save("b5", out)
    print(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    run(sys.argv[1] if len(sys.argv) > 1 else ".test-models/tiny")
