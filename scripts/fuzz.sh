#!/usr/bin/env bash
# The long fuzz run (F1 and the parsers): schemathesis against /openapi.json as two
# tenants, and hypothesis against the JSONL line checker, the Last-Event-ID parser and the
# log formatter's masking gates, with many more examples than the suite's short run. Uses the same Postgres and Redis
# as the test suite. LLMQ_FUZZ_EXAMPLES sets examples per operation (default 2000).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export LLMQ_FUZZ_EXAMPLES="${LLMQ_FUZZ_EXAMPLES:-2000}"
echo "== fuzz: $LLMQ_FUZZ_EXAMPLES examples per operation and per property"
.venv/bin/python -m pytest -p no:cacheprovider tests/api/test_fuzz.py tests/unit/test_parsers_fuzz.py \
    tests/unit/test_log_masking.py "$@"
