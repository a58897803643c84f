"""B1 baseline: the same requests through vLLM's AsyncLLM directly, in one process.

Run as a script (vLLM on CPU spawns processes: the engine must be built under __main__).
Prints one JSON line: {"tokens": ..., "seconds": ...}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import time
from typing import Any

from app.domain.prompts import ChatRenderer
from app.schemas.chat import ChatCompletionV2Request
from app.settings import Settings


async def start_direct(model: str) -> tuple[Any, Any]:
    """The worker's engine built as the service builds it (same engine arguments), and its
    raw AsyncLLM: the baseline drives that directly. The caller closes the engine."""
    from worker.vllm_engine import VllmEngine

    engine = VllmEngine(Settings(model=model))
    await engine.start()
    return engine, engine._llm


async def warm_up(llm: Any, prompt_ids: list[int], tag: str) -> None:
    """Four one-token requests, not measured, as on the service's side."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    warm = SamplingParams(max_tokens=1, output_kind=RequestOutputKind.DELTA)
    for w in range(4):
        async for _ in llm.generate(TokensPrompt(prompt_token_ids=prompt_ids), warm, f"{tag}-warm-{w}"):
            pass


async def main(model: str, bodies: list[dict]) -> dict[str, float]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    engine, llm = await start_direct(model)
    renderer = ChatRenderer.load(model)
    prompts = [renderer.render(ChatCompletionV2Request.model_validate(b)) for b in bodies]

    async def one(i: int) -> int:
        body = bodies[i]
        params = SamplingParams(
            max_tokens=body["max_tokens"], ignore_eos=True, temperature=0, output_kind=RequestOutputKind.DELTA
        )
        count = 0
        async for out in llm.generate(TokensPrompt(prompt_token_ids=prompts[i]), params, f"b1-{i}"):
            count += sum(len(o.token_ids) for o in out.outputs)
        return count

    await warm_up(llm, prompts[0], "b1")
    start = time.perf_counter()
    cpu_start = _own_cpu()
    counts = await asyncio.gather(*(one(i) for i in range(len(bodies))))
    seconds = time.perf_counter() - start
    client_cpu = _own_cpu() - cpu_start
    await engine.close()
    return {"tokens": float(sum(counts)), "seconds": seconds, "client_cpu_seconds": client_cpu}


def _own_cpu() -> float:
    """This process's CPU seconds (the engine core runs in a child: not counted)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--bodies", required=True, help="JSON file with the request bodies")
    a = p.parse_args()
    with open(a.bodies) as f:
        result = asyncio.run(main(a.model, json.load(f)))
    print(json.dumps(result), flush=True)
