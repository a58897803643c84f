#!/usr/bin/env bash
# System packages the test suite needs beyond the Python environment:
# - Debian's pgbouncer (tests/pgbouncer.py puts the database behind it in transaction
#   pooling mode);
# - Debian's prometheus, which brings promtool (tests/integration/test_prometheus.py scrapes a
#   running stack with a real Prometheus and lints every exposition with `promtool check
#   metrics`).
# Installed only when missing, and only as root (CI runs as root on a fresh Debian machine);
# otherwise says what to install.
set -euo pipefail

# package:program it provides
wanted=("pgbouncer:/usr/sbin/pgbouncer" "prometheus:/usr/bin/promtool")
missing=()
for entry in "${wanted[@]}"; do
  package=${entry%%:*}
  program=${entry#*:}
  if ! command -v "$(basename "$program")" >/dev/null && [ ! -x "$program" ]; then
    missing+=("$package")
  fi
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
  echo "== installing ${missing[*]} (Debian packages)"
  DEBIAN_FRONTEND=noninteractive apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  # The packages may start their own services; the tests start theirs on free ports.
  exit 0
fi
echo "missing: ${missing[*]} (sudo apt-get install ${missing[*]}); the tests need them" >&2
exit 1
