"""Run the benchmarks and print a table: `python -m bench.run [--only B1,B2] [--quick]`.

By default B1-B6 and B10, each with its baseline measured in the same run, and the CPU
milliseconds per job or line of each process (API, worker without the engine core, engine
core, Postgres, Redis; bench/cpu.py). Writes JSON under bench/results/, a PNG per curve and
RESULTS.md (the table with the date, machine and load) under docs/bench/ (under
bench/results/ for --quick or --only).
`--quick` runs every benchmark at small sizes (a few minutes): a smoke test of the bench
code, not figures. B7 (~12 minutes), B8 and B9 run only when asked for (`--only B7`).
Start it under the heavy-test lock on a shared machine: `flock /tmp/llmq-heavy.lock ...`.

Stores: LLMQ_DATABASE_URL and LLMQ_REDIS_URL when set, else embedded ones (the CPU of
embedded stores is the service's alone; shared stores are counted whole).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import report
from bench.common import RESULTS, ROOT

DEFAULT = "B1,B2,B3,B4,B5,B6,B10"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=DEFAULT, help="comma-separated benchmark ids")
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke test of the bench code")
    p.add_argument("--model", default=str(ROOT / ".test-models" / "tiny"), help="model folder for B1/B5/B10")
    p.add_argument("--b1-requests", default="64,512", help="B1 request counts")
    p.add_argument("--b1-max-tokens", type=int, default=256)
    p.add_argument("--b7-quick", action="store_true", help="B7 on 5,000 lines (a couple of minutes)")
    p.add_argument("--no-plots", action="store_true")
    a = p.parse_args()
    wanted = {x.strip().upper() for x in a.only.split(",")}
    started = dt.datetime.now(dt.UTC)
    load_before = report.load_average()
    results: list[dict[str, Any]] = []

    def step(name: str, fn: Callable[[], list[dict[str, Any]]]) -> None:
        if name not in wanted:
            return
        try:
            results.extend(fn())
        except Exception as exc:  # one failed benchmark must not hide the others
            traceback.print_exc()
            results.append({"id": name, "error": f"{type(exc).__name__}: {exc}", "goal": ""})

    def b1() -> list[dict[str, Any]]:
        from bench import b1_engine

        counts = [16] if a.quick else [int(n) for n in a.b1_requests.split(",")]
        tokens = 32 if a.quick else a.b1_max_tokens
        return [b1_engine.run(a.model, n, tokens) for n in counts]

    def b2() -> list[dict[str, Any]]:
        from bench import b2_overhead

        return [b2_overhead.run((200, 500, 1_000) if a.quick else (2_000, 10_000, 50_000))]

    def b3() -> list[dict[str, Any]]:
        from bench import b3_submit

        out = b3_submit.run((1, 4), 2.0) if a.quick else b3_submit.run()
        return [out["B3"], out["B6"]]

    def b4() -> list[dict[str, Any]]:
        from bench import b4_ingest

        return [b4_ingest.run(a.model, 2_000, big_lines=500) if a.quick else b4_ingest.run(a.model)]

    def b5() -> list[dict[str, Any]]:
        from bench import b5_stream

        out = b5_stream.run(a.model, (1, 4), 16, 50) if a.quick else b5_stream.run(a.model)
        levels = {k: v for k, v in out.items() if k.startswith("n") and isinstance(v, dict)}
        return [
            {
                "id": "B5",
                **out["summary"],
                "idle": out["idle_streams"]["holding"],
                "levels": levels,
                "cpu_ms_per_job": levels[max(levels, key=lambda k: int(k[1:]))]["cpu_ms_per_job"],
                "goal": out["goal"],
            }
        ]

    def b7() -> list[dict[str, Any]]:
        from bench import b7_scale

        out = b7_scale.run(5_000 if a.b7_quick or a.quick else 20_000)
        return [
            {
                "id": "B7",
                "lines_per_s": "/".join(str(v) for v in out["lines_per_s"].values()),
                "efficiency": "/".join(str(v) for v in out["efficiency"].values()),
                "utilisation_min": min(out["utilisation_min"].values()),
                "goal": out["goal"],
            }
        ]

    def b8() -> list[dict[str, Any]]:
        from bench import b8_fairness

        return [b8_fairness.run()]

    def b9() -> list[dict[str, Any]]:
        from bench import b9_deadlines

        return [b9_deadlines.run()]

    def b10() -> list[dict[str, Any]]:
        from bench import b10_prefix

        return [b10_prefix.run(a.model, lines=320) if a.quick else b10_prefix.run(a.model)]

    # B3 and B6 come from one run.
    if "B6" in wanted:
        wanted.add("B3")
    for name, fn in (
        ("B1", b1),
        ("B2", b2),
        ("B3", b3),
        ("B4", b4),
        ("B5", b5),
        ("B10", b10),
        ("B7", b7),
        ("B8", b8),
        ("B9", b9),
    ):
        step(name, fn)
    print()
    print(report.table(results))
    RESULTS.mkdir(parents=True, exist_ok=True)
    Path(RESULTS / "summary.json").write_text(json.dumps(results, indent=2, default=str))
    # Only a full default run writes docs/bench/ (the README's figures); a quick or partial
    # run's table and plots go to bench/results/.
    full = not a.quick and wanted >= set(DEFAULT.split(","))
    out = report.PLOTS if full else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    made = [] if a.no_plots else report.plots(results, out)
    (out / "RESULTS.md").write_text(report.markdown(results, started, load_before, a.quick))
    print("\nwrote " + ", ".join(str(p.relative_to(ROOT)) for p in [out / "RESULTS.md", *made]))


if __name__ == "__main__":
    main()
