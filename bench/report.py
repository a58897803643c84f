"""The benchmark command's outputs besides the table: one PNG per curve and a markdown
table (with the date, the machine and its load) for the README's performance section."""

from __future__ import annotations

import datetime as dt
import os
import platform
from pathlib import Path
from typing import Any

import psutil

from bench.common import ROOT

PLOTS = ROOT / "docs" / "bench"


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = psutil.virtual_memory().total / 2**30
    return f"{os.cpu_count()} cores ({cpu}), {mem:.0f} GiB RAM, {platform.system()} {platform.release()}"


def load_average() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def figure(r: dict[str, Any]) -> str:
    skip = {"id", "goal", "runs", "curves", "idle"}
    parts = []
    for k, v in r.items():
        if k in skip or isinstance(v, (dict, list)):
            continue
        parts.append(f"{k}={v}")
    return ", ".join(parts)


# A worker thread's share is shown from this many ms per unit (the periodic threads' few
# hundredths are left out).
THREAD_SHOWN_MS = 0.01


def cpu_line(r: dict[str, Any]) -> str:
    """The CPU-per-unit figures a result carries (by process, then the worker's process by
    thread when measured), compactly."""
    for key in ("cpu_ms_per_job", "cpu_ms_per_line"):
        if isinstance(r.get(key), dict):
            unit = "job" if key.endswith("job") else "line"
            cells = " ".join(f"{g}={v}" for g, v in r[key].items() if v)
            threads = r.get(f"worker_threads_ms_per_{unit}")
            if isinstance(threads, dict) and threads:
                shown = " ".join(f"{t}={v}" for t, v in threads.items() if v >= THREAD_SHOWN_MS)
                cells += f"; worker by thread: {shown}"
            return f"ms/{unit}: {cells}"
    return ""


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| id | figure | CPU by process | goal |", "|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['id']} | {figure(r)} | {cpu_line(r)} | {r.get('goal', '')} |")
    return "\n".join(lines)


def markdown(results: list[dict[str, Any]], started: dt.datetime, load_before: str, quick: bool) -> str:
    when = started.strftime("%Y-%m-%d %H:%M UTC")
    mode = " (quick mode: small sizes, a smoke test, not the figures)" if quick else ""
    return (
        f"Measured {when} on {machine()}; load average before {load_before}, after "
        f"{load_average()}{mode}.\n\n{table(results)}\n"
    )


def plots(results: list[dict[str, Any]], out: Path = PLOTS) -> list[Path]:
    """A PNG per curve: B2 (ms per line by batch size), B3 (rate against p99, llmq and
    hello-world), B5 (added time to first chunk and delivery lag by streams), B10 (tokens/s
    and cache hit rate by order)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    made = []
    by_id = {r["id"]: r for r in results}
    if "B2" in by_id and by_id["B2"].get("runs"):
        runs = by_id["B2"]["runs"]
        fig, ax = plt.subplots(figsize=(5, 3.2))
        ax.plot([r["lines"] for r in runs], [r["ms_per_line"] for r in runs], "o-", label="service time")
        ax.axhline(0.2, color="grey", ls="--", label="goal 0.2 ms")
        ax.set_xscale("log")
        ax.set(xlabel="lines in the batch", ylabel="ms per line", title="B2 per-line overhead")
        ax.legend()
        made.append(_save(fig, out / "b2_ms_per_line.png"))
    if "B3" in by_id and by_id["B3"].get("curves"):
        curves = by_id["B3"]["curves"]
        fig, ax = plt.subplots(figsize=(5, 3.2))
        for name, points in curves.items():
            ax.plot([p["rps"] for p in points], [p["p99_ms"] for p in points], "o-", label=name)
        ax.axhline(50, color="grey", ls="--", label="p99 50 ms")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set(xlabel="requests/s (closed loop, 1..32 clients)", ylabel="p99 ms", title="B3 submit rate")
        ax.legend()
        made.append(_save(fig, out / "b3_rate_vs_p99.png"))
    if "B5" in by_id and by_id["B5"].get("levels"):
        levels = by_id["B5"]["levels"]
        xs = sorted(int(k[1:]) for k in levels)
        fig, ax = plt.subplots(figsize=(5, 3.2))
        for key, label in (
            ("added_vs_direct_p99_ms", "TTFC p99 - direct AsyncLLM TTFT p99"),
            ("added_ttfc_p99_ms", "added TTFC p99 (per job)"),
            ("delivery_lag_p99_ms", "delivery lag p99"),
        ):
            ax.plot(xs, [levels[f"n{x}"][key] for x in xs], "o-", label=label)
        ax.set(xlabel="concurrent streams", ylabel="ms", title="B5 stream overhead")
        ax.legend()
        made.append(_save(fig, out / "b5_stream_overhead.png"))
    if "B10" in by_id and by_id["B10"].get("runs"):
        runs = by_id["B10"]["runs"]
        orders = list(runs)
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(6.5, 3.2))
        a1.bar(orders, [runs[o]["generated_tokens_per_s"] for o in orders], color=["#999", "#3a7"])
        a1.set(ylabel="generated tokens/s", title="B10 throughput")
        a2.bar(orders, [runs[o]["prefix_cache_hit_rate"] for o in orders], color=["#999", "#3a7"])
        a2.set(ylabel="prefix-cache hit rate", title="B10 cache hits", ylim=(0, 1))
        made.append(_save(fig, out / "b10_prefix_order.png"))
    return made


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
