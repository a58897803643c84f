"""B5 baseline: B5's streams through vLLM's AsyncLLM directly, in one process, at the same
concurrency levels: each level's requests are started together, as B5's clients start
theirs, and each token's arrival is timed as the caller of `generate` sees it. A level runs
as many rounds as B5 runs it (bench/load.py's `rounds`), so both p99s come from as many requests.

Run as a script (vLLM on CPU spawns processes: the engine must be built under __main__).
Prints one JSON line: {"n<level>": {"ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms",
"itl_p99_ms"}, ...}: time to first token from the call, and the gap between a request's
successive outputs.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import time

from app.domain.prompts import ChatRenderer
from app.schemas.chat import ChatCompletionV2Request
from bench.b1_direct import start_direct, warm_up
from bench.load import pct, rounds


async def main(
    model: str, levels: list[int], max_tokens: int, content: str, samples: int
) -> dict[str, dict[str, float]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    engine, llm = await start_direct(model)
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}
    prompt_ids = ChatRenderer.load(model).render(ChatCompletionV2Request.model_validate(body))
    prompt = TokensPrompt(prompt_token_ids=prompt_ids)
    params = SamplingParams(
        max_tokens=max_tokens, ignore_eos=True, temperature=0, output_kind=RequestOutputKind.DELTA
    )
    ids = itertools.count()

    async def one() -> list[float]:
        """When the call started, then when each output with tokens came."""
        times = [time.perf_counter()]
        async for out in llm.generate(prompt, params, f"b5-{next(ids)}"):
            if any(o.token_ids for o in out.outputs):
                times.append(time.perf_counter())
        return times

    await warm_up(llm, prompt_ids, "b5")
    figures: dict[str, dict[str, float]] = {}
    for n in levels:
        runs = []
        for _ in range(rounds(n, samples)):
            runs += await asyncio.gather(*(one() for _ in range(n)))
        ttft = [(t[1] - t[0]) * 1e3 for t in runs if len(t) > 1]
        itl = [(b - a) * 1e3 for t in runs for a, b in itertools.pairwise(t[1:])]
        figures[f"n{n}"] = {
            "ttft_p50_ms": round(pct(ttft, 50), 2),
            "ttft_p99_ms": round(pct(ttft, 99), 2),
            "itl_p50_ms": round(pct(itl, 50), 2),
            "itl_p99_ms": round(pct(itl, 99), 2),
        }
    await engine.close()
    return figures


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--levels", required=True, help="comma-separated stream counts")
    p.add_argument("--max-tokens", type=int, required=True)
    p.add_argument("--content", required=True, help="the user message B5's requests send")
    p.add_argument("--samples", type=int, default=1, help="requests each level's p99 is read from, at least")
    a = p.parse_args()
    levels = [int(x) for x in a.levels.split(",")]
    result = asyncio.run(main(a.model, levels, a.max_tokens, a.content, a.samples))
    print(json.dumps(result), flush=True)
