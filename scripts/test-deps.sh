#!/usr/bin/env bash
# What the test suite needs beyond the Python environment: Scale's client in a virtual
# environment of its own, and Debian's pgbouncer
# (tests/pgbouncer.py puts the database behind it in transaction pooling mode). Installed
# only when missing, and only as root (CI runs as root on a fresh Debian machine);
# otherwise says what to install.
set -euo pipefail
cd "$(dirname "$0")/.."

# Scale's `scale-llm-engine` client, unchanged, in an environment of its own: it pins
# openai<2, which the project's own dev environment is past (tests/llmengine_driver.py runs
# it there against llmq).
CLIENT=.test-clients/llmengine
if ! LLM_ENGINE_DISABLE_VERSION_CHECK=true "$CLIENT/bin/python" -c "import llmengine" >/dev/null 2>&1; then
  echo "== installing scale-llm-engine into $CLIENT"
  rm -rf "$CLIENT"
  .venv/bin/python -m venv "$CLIENT"
  "$CLIENT/bin/pip" install -q "scale-llm-engine==0.0.0b45"
fi

if command -v pgbouncer >/dev/null || [ -x /usr/sbin/pgbouncer ]; then
  exit 0
fi
if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
  echo "== installing pgbouncer (Debian package)"
  DEBIAN_FRONTEND=noninteractive apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends pgbouncer >/dev/null
  # The package may start its own service; the tests start theirs on free ports.
  exit 0
fi
echo "pgbouncer is missing: install it (sudo apt-get install pgbouncer); the tests need it" >&2
exit 1
