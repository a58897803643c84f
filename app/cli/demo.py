"""The sample run of the README's first command: the sample file goes through the running
service as a batch (upload, create, follow, download), then each answer is printed with the
statistics the worker measured for it."""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from app.cli.batch import submit
from app.cli.client import LlmqClient

# The demo's answers are shown in a few lines each, so the whole run fits on a screen (the
# full answers are in the output file it names).
_ANSWER_LINES = 3
_WIDTH = 160


def _excerpt(answer: str) -> list[str]:
    """The first lines of `answer` (empty ones dropped), each cut to a terminal's width."""
    lines = [x.strip() for x in answer.strip().splitlines() if x.strip()] or ["(empty)"]
    shown = [x if len(x) <= _WIDTH else x[: _WIDTH - 1] + "…" for x in lines[:_ANSWER_LINES]]
    if len(lines) > _ANSWER_LINES:
        shown[-1] += " …"
    return shown


def run_demo(base_url: str, api_key: str, path: Path, *, model: str | None = None) -> dict[str, Any]:
    client = LlmqClient(base_url, api_key)
    work = Path(tempfile.mkdtemp(prefix="llmq-demo-")) / path.name
    shutil.copy(path, work)
    if model:
        lines = [json.loads(x) for x in work.read_text().splitlines() if x.strip()]
        for line in lines:
            line["body"]["model"] = model
        work.write_text("".join(json.dumps(x) + "\n" for x in lines))
    started = time.monotonic()
    batch = submit(client, work, window="1h", wait=True)
    wall = time.monotonic() - started
    out = work.with_name(work.stem + ".output.jsonl")
    generated = 0
    for raw in out.read_text().splitlines() if out.exists() else []:
        line = json.loads(raw)
        answer = line["response"]["body"]["choices"][0]["message"]["content"] or ""
        stats = client.get_job(line["response"]["request_id"])["generation_stats"] or {}
        generated += stats.get("generation_tokens", 0)
        print(
            f"[{line['custom_id']}] {stats.get('prompt_tokens')} prompt + "
            f"{stats.get('generation_tokens')} generated tokens, "
            f"{stats.get('generation_tps', 0):.1f} tok/s (prompt {stats.get('prompt_tps', 0):.0f} tok/s), "
            f"peak memory {stats.get('peak_memory_usage', {}).get('inBytes', 0) / 2**20:.0f} MiB"
        )
        for text in _excerpt(answer):
            print("  " + text)
    errors = work.with_name(work.stem + ".errors.jsonl")
    for raw in errors.read_text().splitlines() if errors.exists() else []:
        line = json.loads(raw)
        print(f"[{line['custom_id']}] failed: {json.dumps(line['response'] or line['error'])[:_WIDTH]}")
    print(
        f"{batch['request_counts']['completed']} of {batch['request_counts']['total']} "
        f"requests in {wall:.1f}s, "
        f"{generated / wall:.1f} generated tok/s overall; files in {work.parent}"
    )
    client.close()
    return batch
