#!/usr/bin/env bash
# Set everything up, then serve the default model on http://127.0.0.1:8080 (OpenAI-compatible).
# Extra arguments go to mlxcel-server, e.g. --port 9000 --parallel 4.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/mlxcel-server -m models/smollm2-135m-instruct "$@"
