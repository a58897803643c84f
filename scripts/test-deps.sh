#!/usr/bin/env bash
# System packages the test suite needs beyond the Python environment: Debian's pgbouncer
# (tests/pgbouncer.py puts the database behind it in transaction pooling mode). Installed
# only when missing, and only as root (CI runs as root on a fresh Debian machine);
# otherwise says what to install.
set -euo pipefail

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
