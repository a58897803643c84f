"""`llmq batch submit|status|cancel|download|tail`: the Batch API from the command line."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import httpx
from tqdm import tqdm

from app.cli.client import LlmqClient, reconnect_wait

TERMINAL = {"completed", "failed", "expired", "cancelled"}


def _done(batch: dict[str, Any]) -> int:
    counts = batch["request_counts"]
    return int(counts["completed"]) + int(counts["failed"])


def follow(
    client: LlmqClient,
    batch_id: str,
    *,
    interval: float = 1.0,
    reconnects: int = 6,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[str, Any]:
    """Poll until the batch ends, with a progress bar: lines done and failed, output
    tokens/s, time left. An API that cannot be reached (restarting after a crash: its
    supervisor brings it back in seconds, the batch runs on) is asked again, `reconnects`
    times in a row at most, `reconnect_wait` apart; then its error is raised."""

    def poll() -> dict[str, Any]:
        failures = 0
        while True:
            try:
                return client.get_batch(batch_id)
            except httpx.TransportError:
                failures += 1
                if failures > reconnects:
                    raise
                sleep(reconnect_wait(failures))

    batch = poll()
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
            sleep(interval)
            batch = poll()


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


def endpoint_of(path: Path) -> str:
    """The batch's endpoint: the first line's `url` (OpenAI requires every line's to be the
    batch's; the server says which line differs), else chat completions."""
    with path.open("rb") as f:
        first = f.readline()
    try:
        url = json.loads(first).get("url")
    except (ValueError, AttributeError):
        url = None
    return url if isinstance(url, str) and url else "/v1/chat/completions"


def submit(client: LlmqClient, path: Path, *, window: str, wait: bool) -> dict[str, Any]:
    uploaded = client.upload_batch_file(path)
    batch = client.create_batch(uploaded["id"], window=window, endpoint=endpoint_of(path))
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


def tail(
    client: LlmqClient, batch_id: str, *, after: str | None = None, out: TextIO | None = None
) -> dict[str, Any] | None:
    """Print the batch's ended lines (output-file lines, one JSON per line) as they come,
    until the batch ends; a summary and the cursor to resume from go to stderr. Returns
    the ended batch (None if the stream stopped before it ended)."""
    out = out or sys.stdout
    cursor, lines = after, 0
    try:
        for event in client.follow_results(batch_id, after=after):
            if event.line is not None:
                out.write(json.dumps(event.line, ensure_ascii=False) + "\n")
                out.flush()
                cursor, lines = event.cursor, lines + 1
            elif event.batch is not None:
                counts = event.batch["request_counts"]
                print(
                    f"batch {batch_id} {event.batch['status']}: {lines} lines shown; "
                    f"{counts['completed']} succeeded, {counts['failed']} failed in all",
                    file=sys.stderr,
                )
                return event.batch
    except KeyboardInterrupt:
        if cursor:
            print(f"\nresume with: llmq batch tail {batch_id} --after {cursor}", file=sys.stderr)
        raise
    print(f"batch {batch_id}: the stream kept dropping; resume with --after {cursor}", file=sys.stderr)
    return None
