#!/usr/bin/env bash
# The pipeline benchmark on a lent NVIDIA H200 (the device tool; no registry there, Python 3.12).
#
# Wheels travel over three calls because one call carries at most 64 MiB with the working tree (../shared/GPU.md;
# bench/gpu/stash.sh): calls 1 and 2 carry .gpu/a, then .gpu/b, and run `bash bench/gpu/stash.sh`; call 3 carries
# .gpu/deps and runs `bash bench/gpu/stash.sh && bash bench/gpu/h200_pipeline.sh run [SHAPES]`.
# Prepare the folders here with bench/gpu/prepare_wheels.sh. Results go to $OUT/<shape>/ (rows and traces).
# SHAPES: comma-separated of bf16, q4 (Qwen3-0.6B shape, random weights; q4 = 4-bit, group 64, bf16 scales).
# PROTECTION=1 also runs part 3 per shape (protected AES-256-GCM against attribution-only unsealed frames,
# bench/protection_bench.py, rows in $OUT/<shape>/pipeline_protection.jsonl); step `protection` instead of `run`
# runs only that part: `bash bench/gpu/stash.sh && bash bench/gpu/h200_pipeline.sh protection q4`.
set -euo pipefail
cd "$(dirname "$0")/../.."
step=${1:-run}
if [ "$step" = stash ]; then exec bash bench/gpu/stash.sh; fi
case $step in run|protection) ;; *) echo "unknown step $step (stash, run, protection)" >&2; exit 2 ;; esac
g=/tmp/gpu  # where bench/gpu/stash.sh keeps the wheels
shapes=${2:-bf16}
RUNS=${RUNS:-5}
TOKENS=${TOKENS:-128}
if [ ! -d /tmp/site/mlx ]; then
  cat $g/a/cuda.part.aa $g/b/cuda.part.ab > /tmp/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl
  (cd /tmp && sha256sum -c $g/b/cuda.sha256)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
    /tmp/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl $g/b/mlx-0.32.4-*.whl $g/b/mlx_lm-*.whl
  ln -sfn /opt/torch/.venv/lib/python3.12/site-packages/nvidia /tmp/site/nvidia
fi
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site $g/deps/*.whl 2>&1 | grep -v WARNING || true
export PYTHONPATH=/tmp/site:$PWD
python3 -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device())"
python3 -c "import mlxcel.entrypoints.stage, mlxcel.server.app"  # the stage and server imports, before any run
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader || true
qwen3_06b=(--family qwen3 --layers 28 --hidden 1024 --heads 16 --kv-heads 8 --head-dim 128 --intermediate 3072 --vocab 151936)
for shape in ${shapes//,/ }; do
  dir=/tmp/q06-$shape
  case $shape in
    bf16) extra=(--dtype bfloat16) ;;
    q4) extra=(--dtype bfloat16 --bits 4 --group-size 64) ;;
    *) echo "unknown shape $shape" >&2; exit 2 ;;
  esac
  [ -e "$dir/config.json" ] || python3 -m mlxcel models make-random "$dir" "${qwen3_06b[@]}" "${extra[@]}"
  label="h200-$shape${LABEL:+-$LABEL}"
  if [ "$step" = run ]; then
    python3 -m bench.pipeline_bench -m "$dir" --runs "$RUNS" --tokens "$TOKENS" --modes "${MODES:-single,inproc_pp,remote_pp}" \
      --streams "" --trace --label "$label" --out "$OUT/$shape"
  fi
  if [ "$step" = protection ] || [ "${PROTECTION:-0}" = 1 ]; then
    python3 -m bench.pipeline_bench protection -m "$dir" --runs "$RUNS" --tokens "$TOKENS" --label "$label" --out "$OUT/$shape"
  fi
done
ls -l "$OUT"/*
