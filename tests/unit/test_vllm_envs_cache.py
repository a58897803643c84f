"""vLLM's settings are read from the environment once the engine has started, not at every
use: its per-step stats read `VLLM_COMPUTE_NANS_IN_LOGITS` for every request, and
`os.getenv` was about a tenth of the worker's output-handling CPU. Run in a process of its
own (importing vllm, and the cache it switches on, stay out of the test process); the engine
itself is a stub, so no model is loaded."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import asyncio
    from vllm import envs
    from vllm.v1.engine.async_llm import AsyncLLM
    from app.settings import Settings
    from worker.vllm_engine import VllmEngine

    AsyncLLM.from_engine_args = classmethod(lambda cls, *a, **k: object())
    print("before", envs._is_envs_cache_enabled())
    asyncio.run(VllmEngine(Settings(model="m", pin_engine_core=False)).start())
    print("after", envs._is_envs_cache_enabled())
    """
)


def test_vllm_settings_are_cached_once_the_engine_has_started() -> None:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["before", "False", "after", "True"], out.stdout
