#!/usr/bin/env bash
# The whole test suite: install, lint, type-check, migrations, unit, API and integration
# tests (real Postgres, Redis, Celery worker and vLLM on the CPU), fault tests and the fleet
# (the Procfile under honcho). Extra arguments go to pytest
# (LLMQ_TEST_VIA_PGBOUNCER=1 puts the database behind PgBouncer for any selection).
# Uses Postgres on 127.0.0.1:5432 and Redis on :6379 when they answer, else starts the
# embedded ones from the wheels.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install.sh
bash scripts/test-deps.sh
bash scripts/scale-client.sh
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
# Both database paths, each tier once: the API tier against Postgres directly (and its
# tests/api/test_pgbouncer.py against a PgBouncer of two server connections), the heavy
# tiers (integration, faults, fleet) with every API, worker and service they
# start behind PgBouncer in transaction pooling mode (tests/pgbouncer.py).
echo "== api tests (Postgres direct)"
.venv/bin/python -m pytest -m api
echo "== integration, fault and fleet tests (behind PgBouncer, transaction mode)"
LLMQ_TEST_VIA_PGBOUNCER=1 .venv/bin/python -m pytest -m "not unit and not api"
