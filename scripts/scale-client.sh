#!/usr/bin/env bash
# Scale's `llmengine` client (scale-llm-engine 0.0.0b45), which the integration tests drive
# unchanged against llmq, in its own virtual environment (.venv-llmengine): it requires
# openai<2, which the project's dev extra (the openai SDK tests, openai>=1.60, resolved to
# 2.x and later) cannot share. The tests run it as a subprocess. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv-llmengine
PIN="scale-llm-engine==0.0.0b45"
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import llmengine" 2>/dev/null; then
  exit 0
fi
echo "== $PIN in $VENV"
python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "$PIN"
