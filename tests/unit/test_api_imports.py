"""The API image has no torch and no vLLM (docker/api.Dockerfile): building the app must not
import them, and counting prompt tokens must work with them absent. Each check runs in a
fresh interpreter, where `sys.modules` shows what the app really imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.helpers import ROOT, TINY_DIR

HEAVY = ("torch", "vllm")

# Unreachable stores: building the app connects to nothing.
BUILD_APP = """
import json, sys
{block}
from app.api import create_app
from app.settings import Settings
create_app(Settings(database_url="postgresql://nobody@127.0.0.1:9/none",
                    redis_url="redis://127.0.0.1:9/0", model={model!r}))
{extra}
print(json.dumps(sorted(m for m in {heavy!r} if sys.modules.get(m) is not None)))
"""

# As in the slim image: `import torch` fails and `find_spec("torch")` finds nothing.
BLOCK_HEAVY = f"for name in {HEAVY!r}: sys.modules[name] = None"

COUNT_TOKENS = """
from app.domain.prompts import ChatRenderer
from app.schemas.chat import ChatCompletionV2Request
req = ChatCompletionV2Request.model_validate(
    {{"model": "tiny", "messages": [{{"role": "user", "content": "how many tokens is this?"}}]}})
tokens = ChatRenderer.load({model!r}).render(req)
assert tokens and all(isinstance(t, int) for t in tokens), tokens
"""


def _imported(code: str) -> list[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMQ_")}
    done = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    imported: list[str] = json.loads(done.stdout.strip().splitlines()[-1])
    return imported


def test_creating_the_api_app_imports_neither_torch_nor_vllm() -> None:
    assert _imported(BUILD_APP.format(block="", model="api-only", extra="", heavy=HEAVY)) == []


def test_the_api_counts_prompt_tokens_with_torch_and_vllm_absent() -> None:
    """The API loads the model's tokenizer (a local folder) and renders its chat template."""
    model = str(TINY_DIR)
    watched = (*HEAVY, "transformers", "tokenizers")
    code = BUILD_APP.format(
        block=BLOCK_HEAVY, model=model, extra=COUNT_TOKENS.format(model=model), heavy=watched
    )
    # The tokenizer really was loaded (and the render's assertions passed in the child).
    assert _imported(code) == ["tokenizers", "transformers"]


def test_with_a_tokenizer_loaded_the_api_still_never_imports_vllm() -> None:
    model = str(TINY_DIR)
    code = BUILD_APP.format(block="", model=model, extra=COUNT_TOKENS.format(model=model), heavy=HEAVY)
    # transformers imports torch itself when it is installed (this dev environment); the
    # API image does not install it. vLLM is never the API's to import.
    assert "vllm" not in _imported(code)
