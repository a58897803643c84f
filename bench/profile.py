"""Where the CPU goes: py-spy samples the API's gunicorn workers and the Celery worker (not
vLLM's engine core) while a load runs, and prints the top frames by own time and, among
llmq's code, by inclusive time.
`python -m bench.profile submit|batch|upload|generate|stream [--seconds 15]`

submit: closed-loop POST /v2/jobs (B3's load); batch: a 50,000-line batch (B2's), sampled
while it runs; upload: B4's 50,000-line file uploaded again and again; generate: B1's load
(rounds of 64 jobs of 256 tokens) on the real engine with the tiny test model (`--model`),
where the worker's own time per generated token shows; stream: B5's load (rounds of 64
concurrent `stream: true` requests of 128 tokens) on the real engine, where the API's time
per relayed chunk shows.
Collapsed stacks are written to bench/results/profile-<load>-<process>.txt (flamegraph.pl
or speedscope read them). Needs py-spy (the dev extra) and the right to ptrace (root).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import psutil

from app.cli.client import LlmqClient
from app.cli.stack import Stack
from bench import b1_engine, b2_overhead, b4_ingest, b5_stream, load
from bench.common import RESULTS, ROOT, service, submit_all, wait_done

OURS = ("(app/", "(worker/", "(bench/")


def py_spy() -> str:
    """The venv's py-spy (installed with the dev extra) when the venv is not on PATH."""
    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.exists() else (shutil.which("py-spy") or "py-spy")


def record(pid: int, seconds: float, out: Path) -> subprocess.Popen[bytes]:
    argv = [
        py_spy(),
        "record",
        "--gil",
        "--format",
        "raw",
        "-r",
        "200",
        "-d",
        str(int(seconds)),
        "-p",
        str(pid),
        "-o",
        str(out),
    ]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def top(collapsed: Path, n: int = 15) -> tuple[list[tuple[str, int]], list[tuple[str, int]], int]:
    """(frames by own samples, llmq frames by inclusive samples, total samples)."""
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in collapsed.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        k = int(count)
        total += k
        frames = stack.split(";")
        own[frames[-1]] += k
        for frame in set(frames):
            if any(part in frame for part in OURS):
                inclusive[frame] += k
    return own.most_common(n), inclusive.most_common(n), total


def _wait_ended(client: LlmqClient, batch_id: str) -> None:
    while client.get_batch(batch_id)["status"] not in ("completed", "failed", "expired", "cancelled"):
        time.sleep(0.5)


def _upload_for(client: LlmqClient, path: Path, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        client.upload_batch_file(path)


def _generate_for(stack: Stack, served: str, seconds: float) -> None:
    """Rounds of B1's 64 jobs of 256 tokens until `seconds` have passed."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        wait_done(stack, submit_all(stack, b1_engine.bodies(64, 256, served)))


def _stream_for(stack: Stack, served: str, seconds: float) -> None:
    """Rounds of B5's 64 concurrent streams of 128 tokens until `seconds` have passed."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        asyncio.run(b5_stream.streams_at(stack.base_url, stack.api_key, served, 64, 128))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("load", choices=("submit", "batch", "upload", "generate", "stream"))
    p.add_argument("--seconds", type=float, default=15)
    p.add_argument("--model", default=str(ROOT / ".test-models" / "tiny"), help="the model for `generate`")
    a = p.parse_args()
    env = {
        "LLMQ_ENGINE": "instant",
        # The per-key limiter still runs (as for a tenant whose limit was raised); the
        # per-tenant cap on active jobs stays at its default.
        "LLMQ_RATE_LIMIT_PER_MINUTE": "100000000",
        "LLMQ_MAX_NUM_SEQS": "64",
        "LLMQ_BATCH_DISPATCH_WINDOW": "2048",
        "LLMQ_BATCH_CHUNK_SIZE": "128",
    }
    model, served = "instant", b2_overhead.SERVED
    if a.load == "generate":  # B1's settings: the defaults, on the real engine
        env, model, served = {}, a.model, "bench-b1"
    elif a.load == "stream":  # B5's: one key holds every stream
        env, model, served = {"LLMQ_MAX_STREAMS_PER_KEY": "128"}, a.model, "bench-b5"
    RESULTS.mkdir(parents=True, exist_ok=True)
    with service(model, served, **env) as stack:
        targets = {f"api{i}": c.pid for i, c in enumerate(psutil.Process(stack.procs["api"].pid).children())}
        targets["worker"] = stack.procs["worker"].pid
        outs = {name: RESULTS / f"profile-{a.load}-{name}.txt" for name in targets}
        if a.load == "submit":
            body = {
                "model": b2_overhead.SERVED,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 16,
            }
            auth = {"Authorization": f"Bearer {stack.api_key}"}
            work = threading.Thread(
                target=load.run,
                args=(load.request_fn(stack.base_url, "POST", "/v2/jobs", body, auth), 4, a.seconds + 2),
            )
        elif a.load == "upload":
            path = Path(tempfile.mkdtemp()) / "profile.jsonl"
            b4_ingest.write_file(path, 50_000, 120, model=b2_overhead.SERVED)
            client = LlmqClient(stack.base_url, stack.api_key, timeout=600)
            work = threading.Thread(target=_upload_for, args=(client, path, a.seconds + 2))
        elif a.load == "generate":
            wait_done(stack, submit_all(stack, b1_engine.bodies(8, 1, served)))  # warm-up
            work = threading.Thread(target=_generate_for, args=(stack, served, a.seconds + 2))
        elif a.load == "stream":
            wait_done(stack, submit_all(stack, b1_engine.bodies(4 * stack.settings.api_workers, 1, served)))
            work = threading.Thread(target=_stream_for, args=(stack, served, a.seconds + 2))
        else:
            # Sampling starts once the batch runs (its upload and creation are B4's).
            path = Path(tempfile.mkdtemp()) / "profile.jsonl"
            b2_overhead.write_batch(path, 50_000)
            client = LlmqClient(stack.base_url, stack.api_key, timeout=600)
            batch = client.create_batch(client.upload_batch_file(path)["id"], window="24h")
            work = threading.Thread(target=_wait_ended, args=(client, batch["id"]))
        work.start()
        time.sleep(1.0)
        spies = [record(pid, a.seconds, outs[name]) for name, pid in targets.items()]
        for spy in spies:
            spy.wait()
        work.join()
    for name, out in outs.items():
        if not out.exists():
            print(f"{name}: no samples (py-spy needs ptrace rights)")
            continue
        own, inclusive, total = top(out)
        print(f"\n== {name}: {total} samples; top own time")
        for frame, k in own:
            print(f"{k / max(total, 1):6.1%}  {frame}")
        print(f"-- {name}: llmq frames, inclusive")
        for frame, k in inclusive:
            print(f"{k / max(total, 1):6.1%}  {frame}")


if __name__ == "__main__":
    main()
