"""Run the benchmarks and print a table: `python -m bench.run [--only B1,B2] [--model DIR]`.
B7 (scale-out, ~12 minutes) runs only when asked for: `--only B7 [--b7-quick]`.

Results are also written as JSON under bench/results/. Stores: LLMQ_DATABASE_URL and
LLMQ_REDIS_URL when set, else embedded ones.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from bench.common import RESULTS, ROOT


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="B1,B2,B4,B5", help="comma-separated benchmark ids")
    p.add_argument("--model", default=str(ROOT / ".test-models" / "tiny"), help="model folder for B1")
    p.add_argument("--b1-requests", type=int, default=64)
    p.add_argument("--b1-max-tokens", type=int, default=256)
    p.add_argument("--b7-quick", action="store_true", help="B7 on 5,000 lines (a couple of minutes)")
    a = p.parse_args()
    wanted = {x.strip().upper() for x in a.only.split(",")}
    results: list[dict[str, Any]] = []
    if "B1" in wanted:
        from bench import b1_engine

        results.append(b1_engine.run(a.model, a.b1_requests, a.b1_max_tokens))
    if "B2" in wanted:
        from bench import b2_overhead

        results.append(b2_overhead.run())
    if "B4" in wanted:
        from bench import b4_ingest

        results.append(b4_ingest.run())
    if "B5" in wanted:
        from bench import b5_stream

        b5 = b5_stream.run(a.model)
        results.append(
            {"id": "B5", **b5["summary"], "idle": b5["idle_streams"]["holding"], "goal": b5["goal"]}
        )
    if "B7" in wanted:
        from bench import b7_scale

        b7 = b7_scale.run(5_000 if a.b7_quick else 20_000)
        results.append(
            {
                "id": "B7",
                "lines_per_s": "/".join(str(v) for v in b7["lines_per_s"].values()),
                "efficiency": "/".join(str(v) for v in b7["efficiency"].values()),
                "utilisation_min": min(b7["utilisation_min"].values()),
                "goal": b7["goal"],
            }
        )
    print()
    print(f"{'id':<4} {'figure':<44} {'goal':<34}")
    for r in results:
        figure = ", ".join(f"{k}={v}" for k, v in r.items() if k not in ("id", "goal"))
        print(f"{r['id']:<4} {figure:<44} {r['goal']:<34}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    Path(RESULTS / "summary.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
