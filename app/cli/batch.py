"""`llmq batch submit|status|cancel|download`: the Batch API from the command line."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from app.cli.client import LlmqClient

TERMINAL = {"completed", "failed", "expired", "cancelled"}


def _done(batch: dict[str, Any]) -> int:
    counts = batch["request_counts"]
    return int(counts["completed"]) + int(counts["failed"])


def follow(client: LlmqClient, batch_id: str, *, interval: float = 1.0) -> dict[str, Any]:
    """Poll until the batch ends, with a progress bar: lines done and failed, output
    tokens/s, time left."""
    batch = client.get_batch(batch_id)
    with tqdm(
        total=batch["request_counts"]["total"], unit="line", desc=batch_id[:18], dynamic_ncols=True
    ) as bar:
        while True:
            bar.n = _done(batch)
            bar.set_postfix(
                failed=batch["request_counts"]["failed"],
                tok_s=batch.get("x_output_tokens_per_second") or 0,
                left_s=batch.get("x_estimated_seconds_left")
                if batch.get("x_estimated_seconds_left") is not None
                else "-",
                status=batch["status"],
            )
            bar.refresh()
            if batch["status"] in TERMINAL:
                return batch
            time.sleep(interval)
            batch = client.get_batch(batch_id)


def download(client: LlmqClient, batch: dict[str, Any], stem: Path) -> list[Path]:
    """FILE.output.jsonl and FILE.errors.jsonl next to `stem` (those that exist)."""
    written = []
    for field, suffix in (("output_file_id", ".output.jsonl"), ("error_file_id", ".errors.jsonl")):
        if batch.get(field):
            path = stem.with_name(stem.name + suffix)
            lines = client.download(batch[field], path)
            print(f"  {path} ({lines} lines)")
            written.append(path)
    return written


def submit(client: LlmqClient, path: Path, *, window: str, wait: bool) -> dict[str, Any]:
    uploaded = client.upload_batch_file(path)
    batch = client.create_batch(uploaded["id"], window=window)
    print(f"uploaded {path} as {uploaded['id']} ({uploaded['bytes']} bytes); batch {batch['id']}")
    if not wait:
        return batch
    batch = follow(client, batch["id"])
    counts = batch["request_counts"]
    print(
        f"batch {batch['id']} {batch['status']}: {counts['completed']} succeeded, {counts['failed']} failed"
    )
    stem = path.with_suffix("") if path.suffix == ".jsonl" else path
    download(client, batch, stem)
    return batch
