#!/usr/bin/env bash
# System packages the test suite needs beyond the Python environment, all Debian's:
# - pgbouncer: tests/pgbouncer.py puts the database behind it in transaction pooling mode;
# - chromium and chromium-driver: tests/integration/test_console.py drives the web console
#   in a real, headless browser through selenium.
# Installed only when missing, and only as root (CI runs as root on a fresh Debian
# machine); otherwise says what to install.
set -euo pipefail

missing=()
if ! command -v pgbouncer >/dev/null && [ ! -x /usr/sbin/pgbouncer ]; then
  missing+=(pgbouncer)
fi
if ! command -v chromium >/dev/null; then
  missing+=(chromium)
fi
if ! command -v chromedriver >/dev/null; then
  missing+=(chromium-driver)
fi

if [ "${#missing[@]}" -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
  echo "== installing ${missing[*]} (Debian packages)"
  # Waits for another apt run (a parallel job on the same machine) instead of failing.
  apt=(apt-get -o DPkg::Lock::Timeout=600 -qq)
  DEBIAN_FRONTEND=noninteractive "${apt[@]}" update
  DEBIAN_FRONTEND=noninteractive "${apt[@]}" install -y --no-install-recommends "${missing[@]}" >/dev/null
  # pgbouncer's package may start its own service; the tests start theirs on free ports.
  exit 0
fi
echo "missing: ${missing[*]}: install them (sudo apt-get install ${missing[*]}); the tests need them" >&2
exit 1
