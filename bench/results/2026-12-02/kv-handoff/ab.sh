#!/usr/bin/env bash
# ABBA: baseline tree (main f7eaeb8 + the bench files) against this worktree; rows into $OUT/{base,new}
set -u
NEW=/work/wt-kv-handoff; BASE=/tmp/kvh-base; OUT=${OUT:-/tmp/kvh/ab}; ROUNDS=${ROUNDS:-2}; MODES=${MODES:-"stages e2e"}
mkdir -p $OUT
run() { (cd $2 && $NEW/.venv/bin/python -m bench.disagg_bench $3 --shape qwen3-0.6b --prompt-tokens 1500 --repeats ${REPEATS:-4} --out $OUT/$1 ${EXTRA:-} >/dev/null 2>&1); }
for r in $(seq 1 $ROUNDS); do
  for m in $MODES; do
    if [ $((r % 2)) = 1 ]; then run base $BASE $m; run new $NEW $m; else run new $NEW $m; run base $BASE $m; fi
  done
done
