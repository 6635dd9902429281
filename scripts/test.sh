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
exec .venv/bin/python -m pytest "$@"
