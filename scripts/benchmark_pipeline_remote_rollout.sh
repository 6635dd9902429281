#!/usr/bin/env bash
# The remote pipeline rollout benchmark (the reference's scripts/benchmark_pipeline_remote_rollout.sh), run
# through bench/pipeline_bench.py. A thin driver: what it measures is documented there and in docs/benchmarks.md.
#
#   scripts/benchmark_pipeline_remote_rollout.sh [--dry-run] MODEL_DIR OUT_DIR [extra pipeline_bench args]
#
# 1. Rollout: greedy decode (EOS ignored) of the 2-stage remote pipeline (stage processes on 127.0.0.3/.4, the
#    coordinator in a fresh worker per run) against the whole model in one fresh process, ABBA order (part 1),
#    then the single-node server against the pipeline coordinator server at STREAMS concurrent streams (part 2).
#    Extra arguments go to this call (e.g. --stage-threads 1, --label my-box).
# 2. Frame protection: the same 2-stage pipeline in one process, AES-256-GCM on every frame against
#    attribution-only unsealed frames, ABBA (part 3, bench/protection_bench.py). PROTECTION=0 skips it.
#
# Rows (JSONL, one object a line, each with the environment: versions, host, date, git commit) are appended to
# OUT_DIR/pipeline_bench.jsonl and OUT_DIR/pipeline_protection.jsonl; `mlxcel report OUT_DIR` renders them.
# Environment: RUNS (5), TOKENS (128), STREAMS (2,4,8; empty skips part 2), STAGES (2), PROTECTION (1),
# PYTHON (the checkout's .venv/bin/python, else python3). --dry-run prints the commands and runs nothing.
set -euo pipefail
usage() { sed -n '5p' "$0" | sed 's/^# *//; s/^/usage: /'; }
dry=0
case "${1:-}" in
  -h|--help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  --dry-run) dry=1; shift ;;
esac
if [ $# -lt 2 ]; then usage >&2; echo "error: MODEL_DIR and OUT_DIR are required" >&2; exit 2; fi
model=$1 out=$2; shift 2
if [ ! -f "$model/config.json" ]; then echo "error: $model is not a model directory (no config.json)" >&2; exit 2; fi
model=$(cd "$model" && pwd)  # both absolute: the benchmark runs from the checkout
case $out in /*) ;; *) out=$PWD/$out ;; esac
repo=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-$([ -x "$repo/.venv/bin/python" ] && echo "$repo/.venv/bin/python" || echo python3)}
rollout=("$python" -m bench.pipeline_bench -m "$model" --stages "${STAGES:-2}" --runs "${RUNS:-5}"
         --tokens "${TOKENS:-128}" --modes single,remote_pp --streams "${STREAMS-2,4,8}" --out "$out" "$@")
protection=("$python" -m bench.pipeline_bench protection -m "$model" --runs "${RUNS:-5}" --tokens "${TOKENS:-128}"
            --out "$out")
cd "$repo"
if [ "$dry" = 1 ]; then
  printf '%q ' "${rollout[@]}"; echo
  if [ "${PROTECTION:-1}" != 0 ]; then printf '%q ' "${protection[@]}"; echo; fi
  exit 0
fi
"${rollout[@]}"
echo "rows: $out/pipeline_bench.jsonl"
if [ "${PROTECTION:-1}" != 0 ]; then
  "${protection[@]}"
  echo "rows: $out/pipeline_protection.jsonl"
fi
