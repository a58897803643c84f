"""The sample run of the README's first command: each request of a JSONL file goes through
the running service as a job; answers and measured stats are printed as they finish."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from app.cli.client import LlmqClient

TERMINAL = {"succeeded", "failed", "cancelled", "expired"}


def read_requests(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """Batch-format lines (`custom_id`, `body`) or bare request bodies."""
    out = []
    for i, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        obj = json.loads(line)
        out.append((obj.get("custom_id", f"line-{i}"), obj.get("body", obj)))
    return out


def run_demo(base_url: str, api_key: str, path: Path, *, model: str | None = None) -> list[dict[str, Any]]:
    client = LlmqClient(base_url, api_key)
    requests = read_requests(path)
    if model:
        for _, body in requests:
            body["model"] = model
    started = time.monotonic()
    jobs = {client.submit_job(body)["id"]: cid for cid, body in requests}
    print(f"submitted {len(jobs)} jobs from {path}", flush=True)
    done: dict[str, dict[str, Any]] = {}
    with tqdm(total=len(jobs), unit="job", desc="running") as bar:
        while len(done) < len(jobs):
            for job_id in jobs:
                if job_id in done:
                    continue
                job = client.get_job(job_id)
                if job["status"] in TERMINAL:
                    done[job_id] = job
                    bar.update(1)
            time.sleep(0.3)
    wall = time.monotonic() - started
    total_tokens = 0
    for job_id, cid in jobs.items():
        job = done[job_id]
        print(f"\n[{cid}] {job['status']}")
        if job.get("response"):
            print(
                "  "
                + (job["response"]["choices"][0]["message"]["content"] or "").strip().replace("\n", "\n  ")
            )
        if job.get("error"):
            print(f"  error: {job['error']['message']}")
        stats = job.get("generation_stats") or {}
        if stats:
            total_tokens += stats["generation_tokens"]
            print(
                f"  stats: {stats['prompt_tokens']} prompt tok, {stats['generation_tokens']} generated tok, "
                f"{stats['generation_tps']:.1f} tok/s, prompt {stats['prompt_tps']:.0f} tok/s, "
                f"peak memory {stats['peak_memory_usage']['inBytes'] / 2**20:.0f} MiB"
            )
    print(f"\n{len(done)} jobs in {wall:.1f}s, {total_tokens / wall:.1f} generated tok/s overall")
    client.close()
    return list(done.values())
