"""The real `llmq demo` (issue 14, "quiet by default"): embedded Postgres and Redis, a Celery
worker running vLLM on the tiny model, the API under gunicorn, the sample batch through it.

Run once with JSON logs on, it shows two things:

- the terminal gets what a person needs, in at most 40 lines: where it listens, the key,
  where the logs are, progress, the answers; no Celery banner, no warnings, no vLLM
  start-up lines, no log records at all;
- every component's log is a file under the data dir, and the worker's (Celery's, vLLM's
  and the engine core process's lines included), the API's (gunicorn's) and `llmq up`'s
  own are JSON through and through, each line with a millisecond timestamp.

The served name is the sample's (`SmolLM2-135M-Instruct`) on the tiny model's weights: the
demo's path without preparing the real model, which the suite cannot afford.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from app.cli.embedded import free_port
from tests.helpers import ROOT

pytestmark = pytest.mark.integration

MS_TIMESTAMP = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z")
SAMPLE = ROOT / "examples" / "sample.jsonl"


@dataclass
class DemoRun:
    returncode: int
    output: str
    data_dir: Path


@pytest.fixture(scope="module")
def demo(tiny_model: Path) -> Iterator[DemoRun]:
    data = Path(tempfile.mkdtemp(prefix="llmq-demo-test-"))
    data.chmod(0o755)  # embedded Postgres runs as an unprivileged user when we are root
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LLMQ_", "VLLM_"))}
    env.update(
        {
            "LLMQ_MODEL": str(tiny_model),
            "LLMQ_SERVED_MODEL_NAME": "SmolLM2-135M-Instruct",
            "LLMQ_API_WORKERS": "1",
            "LLMQ_MAX_NUM_SEQS": "8",
            "LLMQ_KV_CACHE_SPACE_GIB": "1",
            "LLMQ_EMBEDDED_PG_PORT": str(free_port(57200 + secrets.randbelow(200))),
            "LLMQ_EMBEDDED_REDIS_PORT": str(free_port(58200 + secrets.randbelow(200))),
            "LLMQ_LOG_JSON": "true",
            # Every line the worker can write, batch lines' own included, must be JSON too.
            "LLMQ_LOG_LEVEL": "DEBUG",
            "PYTHONPATH": str(ROOT),
        }
    )
    port = free_port(18900 + secrets.randbelow(100))
    try:
        done = subprocess.run(
            # Past --ready-timeout `llmq up` gives up and prints the end of the worker's log.
            [
                *(sys.executable, "-m", "app.cli.main", "demo", "--port", str(port)),
                *("--data-dir", str(data), "--ready-timeout", "300"),
            ],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            timeout=600,
            check=False,
        )
        yield DemoRun(done.returncode, done.stdout.decode(errors="replace"), data)
    finally:
        shutil.rmtree(data, ignore_errors=True)


def test_the_demo_prints_what_a_person_needs_in_at_most_40_lines(demo: DemoRun) -> None:
    out = demo.output
    assert demo.returncode == 0, out
    # Lines as a terminal shows them: the progress bar redraws its one line with `\r`.
    lines = out.rstrip("\n").split("\n")
    assert len(lines) <= 40, f"{len(lines)} lines:\n{out}"
    key = (demo.data_dir / "api_key").read_text().strip()
    assert "llmq is ready" in out and "base URL : http://127.0.0.1:" in out
    assert f"API key  : {key}" in out
    assert f"logs     : {demo.data_dir.resolve() / 'logs'}" in out
    custom_ids = [json.loads(x)["custom_id"] for x in SAMPLE.read_text().splitlines() if x.strip()]
    for custom_id in custom_ids:
        assert f"[{custom_id}] " in out
    assert f"{len(custom_ids)} of {len(custom_ids)} requests" in out
    assert "stopped; data kept in" in out
    # None of the components' output: no banner, no warning, no log record, no vLLM.
    for noise in ("celery@", "[queues]", "Warning", "WARNING", "vllm", '"level"', "gunicorn", "Traceback"):
        assert noise not in out, f"{noise!r} on the terminal:\n{out}"


def json_records(path: Path) -> list[dict[str, Any]]:
    """Every line of `path` as a JSON object; fails on the first line that is not one."""
    records = []
    for number, raw in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except json.JSONDecodeError:
            pytest.fail(f"{path.name} line {number} is not JSON: {raw[:300]!r}")
        assert isinstance(record, dict), raw
        assert MS_TIMESTAMP.fullmatch(record.get("ts", "")), f"{path.name} line {number}: {raw[:300]}"
        assert {"level", "logger", "msg", "pid"} <= set(record), raw[:300]
        records.append(record)
    return records


def test_every_component_logs_to_a_file_under_the_data_dir_in_json(demo: DemoRun) -> None:
    assert demo.returncode == 0, demo.output
    logs = demo.data_dir / "logs"
    worker = json_records(logs / "worker.log")
    api = json_records(logs / "api.log")
    up = json_records(logs / "llmq.log")
    assert up and api

    loggers = {r["logger"] for r in worker}
    assert any(name.startswith("vllm") for name in loggers), sorted(loggers)
    assert any(name.startswith("celery") for name in loggers), sorted(loggers)
    assert any(name.startswith("llmq.") for name in loggers), sorted(loggers)
    # vLLM's engine core is a process of its own, configured from the environment alone:
    # its lines (another pid than the worker's) are JSON as well.
    worker_pid = next(r["pid"] for r in worker if r["logger"] == "llmq.engine")
    engine_pids = {r["pid"] for r in worker if r["logger"].startswith("vllm")} - {worker_pid}
    assert engine_pids, "no line from vLLM's engine core process"
    # The worker's lines for a job carry the request id of the request that created it.
    job_lines = [r for r in worker if r.get("job_id") and r["logger"] == "llmq.runner"]
    assert job_lines and all(str(r.get("request_id", "")).startswith("req_") for r in job_lines)
    # The embedded stores keep their own logs under the data dir.
    assert list(demo.data_dir.rglob("server.log")) and list(demo.data_dir.rglob("redis.log"))
