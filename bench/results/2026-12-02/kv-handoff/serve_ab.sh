#!/usr/bin/env bash
# disagg_bench handoff (real CLI processes: hybrid vs router -> prefill -> decode), base tree vs this worktree
OUT=${OUT:-/tmp/kvh/serve}; M=/work/wt-kv-handoff/models/smollm2-135m-instruct
for tree in ${TREES:-new base}; do
  dir=/work/wt-kv-handoff; [ $tree = base ] && dir=/tmp/kvh-base
  (cd $dir && /work/wt-kv-handoff/.venv/bin/python -m bench.disagg_bench handoff -m $M --prompt-tokens 1500 \
     --repeats ${REPEATS:-3} --max-tokens 8 --parallel 2 --out $OUT/$tree > $OUT-$tree.log 2>&1)
done
