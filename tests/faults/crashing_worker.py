"""`python -m tests.faults.crashing_worker`: a worker whose instant engine kills the whole
worker process when a prompt holds `CRASH_MARKER`, as a poison request might (R10), and
dies as an engine (every request in it fails with `EngineDead`, as when vLLM's engine core
segfaults) when a request's structured-output choices hold `ENGINE_CRASH_CHOICE` (X8).

Test-only: production code has no way to be killed from a prompt. The launcher swaps the
worker's engine factory, then runs the ordinary worker entry point.
"""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator

from app.settings import Settings
from worker import __main__ as worker_main
from worker import runtime
from worker.engine import Engine, EngineDead, EngineUpdate, GenerationSpec, InstantEngine
from worker.translate import Renderer

CRASH_MARKER = "__llmq_test_crash__"
ENGINE_CRASH_CHOICE = "__llmq_engine_crash__"


class CrashingEngine(InstantEngine):
    dead = False

    async def generate(self, spec: GenerationSpec) -> AsyncIterator[EngineUpdate]:
        # The instant engine's prompt ids are the UTF-8 bytes of the messages (ByteRenderer).
        if CRASH_MARKER.encode() in bytes(b for b in spec.prompt_token_ids if b < 256):
            os.kill(os.getpid(), signal.SIGKILL)
        choices = (spec.sampling.get("structured_outputs") or {}).get("choice") or []
        if ENGINE_CRASH_CHOICE in choices:
            CrashingEngine.dead = True
        async for update in super().generate(spec):
            if CrashingEngine.dead:
                raise EngineDead("the engine core died (test)")
            yield update
        if CrashingEngine.dead:
            raise EngineDead("the engine core died (test)")


_build_engine = runtime.build_engine


def build_engine(settings: Settings) -> tuple[Engine, Renderer]:
    engine, renderer = _build_engine(settings)
    if isinstance(engine, InstantEngine):
        engine = CrashingEngine(context=engine.max_model_len(), delay=settings.instant_token_seconds)
    return engine, renderer


if __name__ == "__main__":
    runtime.build_engine = build_engine
    worker_main.main()
