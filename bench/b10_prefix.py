"""B10 prefix order: a batch whose 2,000 lines use 16 system prompts of about 400 tokens,
shuffled, run with prefix-aware line order (the default) and with `x_line_order: "input"`
(the baseline, same run), on a KV cache too small to hold every prefix at once
(`LLMQ_KV_CACHE_BLOCKS`). Reports generated tokens/s of each, their ratio (goal ≥ 1.3),
vLLM's prefix-cache hit rate for each (its cached prompt tokens over all prompt tokens,
summed from the lines' usage), and CPU ms per line by process.

Each order gets its own set of prompts, so neither starts with the other's cache.
"""

from __future__ import annotations

import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from sqlalchemy import text

from app.cli.client import LlmqClient
from app.connections import ADMIN_POOL
from app.db import Database
from bench import cpu
from bench.common import save, service

SERVED = "bench-b10"
WORDS = [
    "queue",
    "batch",
    "token",
    "engine",
    "worker",
    "cache",
    "prefix",
    "system",
    "prompt",
    "reply",
    "answer",
    "careful",
    "brief",
    "polite",
    "expert",
    "review",
    "classify",
    "summarise",
    "extract",
    "label",
    "sentiment",
    "topic",
    "language",
    "customer",
    "order",
    "refund",
]


def system_prompts(model: str, count: int, tokens: int, seed: int) -> list[str]:
    """`count` distinct system prompts of about `tokens` tokens each (by the model's tokenizer)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    rng = random.Random(seed)
    prompts = []
    for p in range(count):
        words = [f"You are assistant {seed}-{p}."]
        while len(tok(" ".join(words))["input_ids"]) < tokens:
            words.append(rng.choice(WORDS))
        prompts.append(" ".join(words))
    return prompts


def write_batch(path: Path, prompts: list[str], lines: int, max_tokens: int, seed: int) -> None:
    which = [i % len(prompts) for i in range(lines)]
    random.Random(seed).shuffle(which)
    with path.open("w") as f:
        for i, p in enumerate(which):
            body = {
                "model": SERVED,
                "messages": [
                    {"role": "system", "content": prompts[p]},
                    {"role": "user", "content": f"Question {i}: what should I do next?"},
                ],
                "max_tokens": max_tokens,
                "ignore_eos": True,
                "temperature": 0,
            }
            line = {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
            f.write(json.dumps(line) + "\n")


_FIGURES = text(
    """
    SELECT count(*) FILTER (WHERE status = 'succeeded') AS ok,
           extract(epoch FROM max(succeeded_at) - min(started_at)) AS wall,
           coalesce(sum((usage->>'completion_tokens')::bigint), 0) AS generated,
           coalesce(sum((usage->>'prompt_tokens')::bigint), 0) AS prompt,
           coalesce(sum((usage->'prompt_tokens_details'->>'cached_tokens')::bigint), 0) AS cached
    FROM jobs WHERE batch_id = :batch
    """
)


def one(stack: Any, client: LlmqClient, path: Path, order: str, lines: int) -> dict[str, Any]:
    uploaded = client.upload_batch_file(path)
    with cpu.measure(stack) as use:
        batch = client.create_batch(uploaded["id"], window="24h", line_order=order)
        while batch["status"] not in ("completed", "failed", "expired", "cancelled"):
            time.sleep(0.5)
            batch = client.get_batch(batch["id"])
    db = Database.from_url(stack.env["LLMQ_DATABASE_URL"], ADMIN_POOL)
    try:
        with db.session() as s:
            row = s.execute(_FIGURES, {"batch": batch["id"]}).one()
    finally:
        db.dispose()
    return {
        "order": order,
        "lines": lines,
        "succeeded": int(row.ok),
        "seconds": round(float(row.wall), 2),
        "generated_tokens_per_s": round(float(row.generated) / float(row.wall), 1),
        "prefix_cache_hit_rate": round(float(row.cached) / max(float(row.prompt), 1.0), 3),
        "cpu_ms_per_line": use.per_unit_ms(lines),
    }


def run(
    model: str,
    lines: int = 2_000,
    prompts: int = 16,
    prompt_tokens: int = 400,
    max_tokens: int = 16,
    kv_blocks: int = 40,
    max_num_seqs: int = 16,
) -> dict[str, Any]:
    """`kv_blocks` of 128 tokens: 40 hold about 12 of the 16 prefixes with nothing running."""
    tmp = Path(tempfile.mkdtemp(prefix="llmq-b10-"))
    files = {}
    for seed, order in enumerate(("input", "prefix"), start=1):
        files[order] = tmp / f"b10-{order}.jsonl"
        texts = system_prompts(model, prompts, prompt_tokens, seed)
        write_batch(files[order], texts, lines, max_tokens, seed)
    env = {"LLMQ_KV_CACHE_BLOCKS": str(kv_blocks), "LLMQ_MAX_NUM_SEQS": str(max_num_seqs)}
    with service(model, SERVED, **env) as stack:
        client = LlmqClient(stack.base_url, stack.api_key, timeout=600)
        runs = {order: one(stack, client, path, order, lines) for order, path in files.items()}
        client.close()
    result = {
        "id": "B10",
        "lines": lines,
        "prompts": prompts,
        "kv_cache_tokens": kv_blocks * 128,
        "input_tokens_per_s": runs["input"]["generated_tokens_per_s"],
        "prefix_tokens_per_s": runs["prefix"]["generated_tokens_per_s"],
        "ratio": round(runs["prefix"]["generated_tokens_per_s"] / runs["input"]["generated_tokens_per_s"], 3),
        "hit_rate_input": runs["input"]["prefix_cache_hit_rate"],
        "hit_rate_prefix": runs["prefix"]["prefix_cache_hit_rate"],
        "cpu_ms_per_line": runs["prefix"]["cpu_ms_per_line"],
        "runs": runs,
        "goal": ">= 1.3",
    }
    save("b10", result)
    return result
