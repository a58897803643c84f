#!/usr/bin/env bash
# The whole test suite: install, lint, type-check, migrations, unit, API and integration
# tests (real Postgres, Redis, Celery worker and vLLM on the CPU), fault tests and the fleet
# (the Procfile under honcho). Extra arguments go to pytest.
# Uses Postgres on 127.0.0.1:5432 and Redis on :6379 when they answer, else starts the
# embedded ones from the wheels.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install.sh
echo "== lint and types"
.venv/bin/ruff check app worker tests bench
.venv/bin/ruff format --check app worker tests bench
.venv/bin/mypy
echo "== tiny test model"
[ -f .test-models/tiny/config.json ] || .venv/bin/llmq model build-tiny .test-models/tiny
if [ $# -gt 0 ]; then
  exec .venv/bin/python -m pytest "$@"
fi
# The unit tier must pass with no server reachable: point it at addresses where none is.
echo "== unit tests (no Postgres, no Redis)"
LLMQ_TEST_PG_URL=postgresql://nobody@127.0.0.1:9/none LLMQ_TEST_REDIS_URL=redis://127.0.0.1:9 \
  .venv/bin/python -m pytest -m unit -q
echo "== api, integration, fault and fleet tests"
.venv/bin/python -m pytest -m "not unit"
