#!/usr/bin/env bash
# Set everything up, then run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Headless Chromium for the report's browser test (tests/report/test_report_browser.py): Debian's package,
# best effort (root with apt-get only); without it that test skips and says why.
if [ "$(uname -s)" = Linux ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 &&
   ! command -v chromium >/dev/null 2>&1; then
  echo "==> installing chromium (Debian package) for the report's headless browser test"
  export DEBIAN_FRONTEND=noninteractive
  if ! { apt-get install -y -qq chromium >/dev/null 2>&1 ||
         { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq chromium >/dev/null 2>&1; }; }; then
    echo "    (could not install chromium; the report's browser test will skip)"
  fi
fi
# Test workers (pytest-xdist): the tests wait on processes and sockets much of the time, so two workers pay off
# even on two cores. A module's tests stay on one worker (--dist loadscope), so a module-scoped cluster or
# deployment starts once. MLXCEL_TEST_WORKERS=0 runs in this process (no workers), for debugging.
workers=${MLXCEL_TEST_WORKERS:-$(n=$(nproc 2>/dev/null || echo 2); [ "$n" -lt 2 ] && n=2; [ "$n" -gt 4 ] && n=4; echo "$n")}
if [ "$workers" = 0 ]; then
  exec .venv/bin/python -m pytest "$@"
fi
exec .venv/bin/python -m pytest -n "$workers" --dist loadscope "$@"
