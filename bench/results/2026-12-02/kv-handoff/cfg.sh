#!/usr/bin/env bash
# e2e AES per (intake workers, crypto workers), rounds alternating the order
cd /work/wt-kv-handoff
OUT=${OUT:-/tmp/kvh/cfg}; mkdir -p $OUT
CFGS=${CFGS:-"0:0 1:0 0:2 1:2"}
for r in 1 2; do
  list=$CFGS; [ $r = 2 ] && list=$(echo $CFGS | tr ' ' '\n' | tac | tr '\n' ' ')
  for c in $list; do
    i=${c%%:*}; w=${c##*:}
    MLXCEL_HANDOFF_INTAKE_WORKERS=$i .venv/bin/python -m bench.disagg_bench e2e --shape qwen3-0.6b --prompt-tokens 1500 \
      --repeats ${REPEATS:-4} --suites aes --crypto-workers $w --out $OUT/i$i-w$w >/dev/null 2>&1
  done
done
