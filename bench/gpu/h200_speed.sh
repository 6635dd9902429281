#!/usr/bin/env bash
# Issue 24 item 1 (the stage step) and issue 23 item 6 (MoE rows) on a lent NVIDIA H200.
#
# The wheels travel over three device calls (bench/gpu/stash.sh says how; prepare them with
# bench/gpu/prepare_wheels.sh), the code as the session's checkout; the third call runs this script:
#   bash bench/gpu/stash.sh && MLXCEL_GIT_COMMIT=<sha> bash bench/gpu/h200_speed.sh SUITE...
# (A helper's worktree is not what the device tool sends: copy its code to .gpu/src, carry that too, and run
# .gpu/src/bench/gpu/h200_speed.sh.) GPU_DIR (default /tmp/gpu) is where stash.sh put the wheels.
# SUITES (run in order, each skipped once less than its budget is left of DEADLINE_S, default 560 s):
#   q06-bf16 q06-q4   Qwen3-0.6B shape, 5 ABBA runs x (single, in-process 2, remote 2 protected), 128 tokens,
#                     for every lever set in LEVERS (default "compile0": the default build; mps: the same with
#                     every process of the batch a client of one CUDA MPS server, so processes sharing the one
#                     GPU share one context instead of taking turns). The levers compile1 (MLXCEL_COMPILE_STEP=1),
#                     overlap1 and mps-overlap1 (MLXCEL_STAGE_OVERLAP=1) were removed with their switches
#                     (issue 41; docs/benchmarks.md keeps their rows): naming one stops with "removed"
#   q8b-q4            Qwen3-8B shape 4-bit (36 layers, hidden 4096, 32/8 heads, intermediate 12288)
#   moe30b-q4         Qwen3-30B-A3B shape 4-bit (48 layers, hidden 2048, 128 experts, 8 active, width 768) + moe_probe
#   ds-q4             deepseek_v3 classes at DeepSeek-V2-Lite's scale (27 layers, hidden 2048, 64 experts, 6 active,
#                     width 1408, 2 shared, MLA rank 512) 4-bit + moe_probe
#   pingpong-bf16 pingpong-q4 pingpong-q8b   bench/gpu/pingpong_probe.py on q06-bf16 / q06-q4 / q8b-q4: one token
#                     as the whole model (async, sync), two halves in one process, two halves in two processes
#                     (PROBE_ROUNDS, default 2; PROBE_MODES, default every mode); pingpong-mps-bf16: the same on
#                     q06-bf16 under one CUDA MPS server
#   protection-bf16 protection-q4   the reference's headline: greedy decode of the 2-stage remote pipeline (both
#                     stages and the coordinator in one process), AES-256-GCM on every frame against attribution-only
#                     unsealed frames, RUNS (5) ABBA rounds of TOKENS tokens on q06-bf16 / q06-q4 (bench/protection_bench.py;
#                     rows in protection/pipeline_protection.jsonl); protection-tiny: a smoke test on the tiny shape
#   structured-bf16 structured-q4   issue 42 item 9: the single-node server's tokens/s with and without a JSON schema
#                     (response_format json_schema: the grammar's token mask) at 1 and 32 streams (STRUCTURED_STREAMS),
#                     identical prompts, STRUCTURED_ROUNDS (4) ABBA rounds, TOKENS tokens a request, on q06-bf16 / q06-q4
#                     (bench/structured_bench.py; rows in structured/structured_output.jsonl); structured-tiny: a smoke test
#   agent-bf16 agent-q4   issue 44 item 3: bench/agent_turns.py, 4 growing tool-call conversations (AGENT_TURNS, 16
#                     turns; AGENT_WORDS, 270 words a tool result: ~31k prompt tokens with the random checkpoints'
#                     byte-level tokenizer, refused above 32768; the server's context limit permitting; AGENT_SYSTEM_WORDS,
#                     300 words of system notes, shared by the conversations; a coding agent's shape is a long
#                     shared system prompt and short results, e.g. AGENT_SYSTEM_WORDS=1800 AGENT_WORDS=100) on
#                     q06-bf16 / q06-q4, AGENT_PRESET (today: single, pipeline, round-robin and prefix routing; full: each also with
#                     --kv-bits 8), AGENT_REPEATS (2) ABBA repeats, AGENT_CACHE_MB (16000) MiB of prefix cache on the
#                     roles that keep one (31k tokens of this shape take 3.4 GB) (rows in agent/agent_turns.jsonl);
#                     AGENT_VARIANTS ('|'-separated --variant values) instead of the preset; agent-tiny: a smoke test
#   kvbits-bf16       issue 44 item 2: bench/decode_bench.py on q06-bf16, full-precision KV (0) against --kv-bits 8 and 4
#                     (group 64) at KV_CONTEXTS (default "2048 8192 16384") prompt tokens, KV_RUNS (3) ABBA runs of
#                     TOKENS tokens, mlxcel and mlx-lm (its kv_bits) in one process: decode tok/s and the KV cache's
#                     bytes (rows in kvbits/decode_bench.jsonl)
#   probe-bf16        removed with the compiled step (issue 41): bench/gpu/step_probe.py measured it
#   serve             issue 24 item 2: the single-node server (mlxcel serve, asynchronous scheduling) and
#                     mlx_lm.server, as users start them (SERVE_KINDS, default mlxcel,mlx_lm; add mlxcel-sync,
#                     MLXCEL_ASYNC_SCHED=0, only on its own: three servers on one GPU ran out of memory), on q06-q4 then
#                     q06-bf16: bench/serve_bench.py, identical streaming prompts, ABBA over 2 rounds (SERVE_ROUNDS), 1/8/32 streams
#                     (SERVE_STREAMS), SERVE_REQUESTS (2) requests of TOKENS tokens per client, GPU utilisation
#                     sampled by nvidia-smi every 100 ms during each level, the mlxcel server's step trace
#                     (summarised by bench/step_trace.py); about 3.5 min per checkpoint
#   STAGE_DEVICES=0,1   one GPU per stage process (CUDA_VISIBLE_DEVICES; the nvidia-h200-x2 machine); LABEL (h200)
#               prefixes the rows' label
#   STREAMS=8   also part 2 of pipeline_bench: the single-node server against coordinator + stages at those streams
#   handoff           issue 24 item 3, the KV handoff (~6 min): disagg_bench stages and e2e on the Qwen3-0.6B KV
#                     shape (172 MB bf16 at 1,500 tokens; e2e per "crypto:intake" workers in HANDOFF_WORKERS,
#                     default "0:0 2:0 2:4 4:4 8:4 4:1"; then split over lanes per "lanes:crypto:intake" in
#                     HANDOFF_LANE_RUNS, default "2:0:0 4:0:0 4:0:4 8:0:4"), then disagg_bench handoff (hybrid vs router -> prefill -> decode) on the q06-bf16
#                     checkpoint, 1,500-token prompts, HANDOFF_REPEATS (default 4) ABBA requests: rows in
#                     handoff/disagg_bench.jsonl (environment included)
#   managed-probe     bench/gpu/managed_probe.py: the host reading and writing 172 MB of KV in MLX's CUDA (managed)
#                     memory, page faults against a prefetch or cudaMemcpy, and AES-GCM over it
#   prefill-probe     bench/gpu/prefill_probe.py on q06-bf16: host cost of prompt chunks by length (first use
#                     against repeats) and of a 32-row decode step
#   profile           issue 24 item 2: py-spy samples (Python and native) of mlxcel serve at 32 streams on
#                     PROFILE_MODEL (q06-bf16), with its step trace; needs py-spy at PY_SPY (/tmp/py-spy, carried in part A)
#   handoff-profile   issue 24 item 3: py-spy of the decode and prefill nodes while 8 streams of 1,500-token
#                     prompts go through router -> prefill -> decode on q06-bf16 (needs py-spy, as profile)
#   handoff-serving   issue 24 item 3: disagg_bench handoff (1 stream) and serve (1 and 8 streams, 1,500-token prompts)
#                     on q06-bf16, hybrid against router -> prefill -> decode, the serve pass over
#                     HANDOFF_TOPOLOGIES (default "hybrid,1p1d-lanes1,1p1d": one handoff lane against the default)
#                     HANDOFF_ROUNDS (2: each topology first once per pair of rounds, ABBA)
#                     at HANDOFF_STREAMS (default 1,8); HANDOFF_ONE_STREAM=0 skips the 1-stream handoff pass
# Everything lands in $OUT/results.tar.gz (rows, traces, logs) and $OUT/log.txt.
set -uo pipefail
SRC=$(cd "$(dirname "$0")/../.." && pwd)
GPU_DIR=${GPU_DIR:-/tmp/gpu}
T0=$(date +%s)
DEADLINE_S=${DEADLINE_S:-560}
RUNS=${RUNS:-5}
TOKENS=${TOKENS:-128}
LEVERS=${LEVERS:-compile0}
RES=/tmp/results
mkdir -p "$RES"
left() { echo $(( DEADLINE_S - ($(date +%s) - T0) )); }

# CUDA MPS: one server process holds the GPU's context, and every CUDA process started meanwhile runs through it.
# The daemon is this run's own (pipe and log under /tmp/mps) and quits when the lever or suite ends, or on exit.
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps/log
mps_start() {
  command -v nvidia-cuda-mps-control >/dev/null || { echo "== no nvidia-cuda-mps-control here"; return 1; }
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d && touch /tmp/mps/on && echo "== MPS server on"
}
mps_stop() {
  [ -e /tmp/mps/on ] || return 0
  rm -f /tmp/mps/on; echo quit | timeout 20 nvidia-cuda-mps-control; sleep 1; echo "== MPS server off"
}
trap mps_stop EXIT

install() {
  [ -d /tmp/site/mlx ] || [ -n "${SKIP_INSTALL:-}" ] && return 0
  cat "$GPU_DIR/a/cuda.part.aa" "$GPU_DIR/b/cuda.part.ab" > /tmp/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl
  (cd /tmp && sha256sum -c "$GPU_DIR/b/cuda.sha256") || exit 3
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
    /tmp/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl "$GPU_DIR"/b/mlx-0.32.4-*.whl "$GPU_DIR"/b/mlx_lm-*.whl
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site "$GPU_DIR"/deps/*.whl 2>&1 | grep -v WARNING
  ln -sfn /opt/torch/.venv/lib/python3.12/site-packages/nvidia /tmp/site/nvidia
}

make_model() {  # name -> /tmp/models/name (built here, on the GPU)
  local dir=/tmp/models/$1
  [ -e "$dir/config.json" ] && return 0
  # a 40k context (make-random writes 2048): the agent suites send prompts up to 32k tokens
  local q06=(--family qwen3 --layers 28 --hidden 1024 --heads 16 --kv-heads 8 --head-dim 128 --intermediate 3072 --vocab 151936
             --set max_position_embeddings=40960)
  local q4=(--dtype bfloat16 --bits 4 --group-size 64)
  local args
  case $1 in
    tiny) args=(--family qwen3_moe --layers 4 --hidden 128 --heads 4 --kv-heads 2 --set num_experts=8 "${q4[@]}") ;;
    q06-bf16) args=("${q06[@]}" --dtype bfloat16) ;;
    q06-q4) args=("${q06[@]}" "${q4[@]}") ;;
    q8b-q4) args=(--family qwen3 --layers 36 --hidden 4096 --heads 32 --kv-heads 8 --head-dim 128 --intermediate 12288
                  --vocab 151936 "${q4[@]}") ;;
    moe30b-q4) args=(--family qwen3_moe --layers 48 --hidden 2048 --heads 32 --kv-heads 4 --head-dim 128 --intermediate 6144
                     --vocab 151936 --set num_experts=128 --set num_experts_per_tok=8 --set moe_intermediate_size=768
                     "${q4[@]}") ;;
    ds-q4) args=(--family deepseek_v3 --layers 27 --hidden 2048 --heads 16 --kv-heads 16 --intermediate 10944 --vocab 102400
                 --set n_routed_experts=64 --set num_experts_per_tok=6 --set moe_intermediate_size=1408
                 --set n_shared_experts=2 --set first_k_dense_replace=1 --set kv_lora_rank=512 --set q_lora_rank=null
                 --set qk_rope_head_dim=64 --set qk_nope_head_dim=128 --set v_head_dim=128 "${q4[@]}") ;;
    *) echo "unknown model $1" >&2; return 2 ;;
  esac
  local t=$(date +%s)
  python3 -m mlxcel models make-random "$dir" "${args[@]}" && echo "made $1 in $(( $(date +%s) - t )) s, $(du -sh "$dir" | cut -f1)"
}

bench() {  # model lever
  local model=$1 lever=$2 stage_env=() mps=0
  case $lever in mps*) mps=1; lever=${lever#mps}; lever=${lever#-}; lever=${lever:-compile0} ;; esac
  case $lever in
    compile0) ;;  # the default build
    compile1|overlap1) echo "lever $lever removed (issue 41: MLXCEL_COMPILE_STEP, MLXCEL_STAGE_OVERLAP)"; return 2 ;;
    *) echo "unknown lever $lever"; return 2 ;;
  esac
  [ $mps = 1 ] && { mps_start || return 0; lever=mps-$lever; }
  echo "== $model $lever ($(left) s left)"
  python3 -m bench.pipeline_bench -m "/tmp/models/$model" --runs "$RUNS" --tokens "$TOKENS" \
    --modes "${MODES:-single,inproc_pp,remote_pp}" --streams "${STREAMS:-}" --trace --reuse-workers "${stage_env[@]}" \
    ${STAGE_DEVICES:+--stage-devices "$STAGE_DEVICES"} \
    --label "${LABEL:-h200}-$model-$lever" --out "$RES/$model-$lever" 2>&1 | grep -v "^WARNING"
  [ $mps = 1 ] && mps_stop
  return 0
}

suite() {  # suite name, its budget in seconds
  local name=$1 budget=$2
  if [ "$(left)" -lt "$budget" ]; then echo "== skip $name: $(left) s left, needs $budget"; return 0; fi
  make_model "$name" || return 0
  for lever in $LEVERS; do
    if [ "$(left)" -lt $(( budget / 2 )) ]; then echo "== skip $name $lever: $(left) s left"; continue; fi
    bench "$name" "$lever"
  done
  case $name in moe30b-q4|ds-q4|tiny)
    [ "$(left)" -gt 60 ] && python3 -m bench.gpu.moe_probe -m "/tmp/models/$name" --steps 64 --label "h200-$name" \
      --out "$RES/moe_probe.jsonl" ;;
  esac
  rm -rf "/tmp/models/$name"  # the disk holds 64 GiB
}

one_stream_handoffs() {  # dir: disagg_bench handoff on q06-bf16, hybrid against router -> prefill -> decode, ABBA
  echo "== handoff serving, 1 stream, q06-bf16 ($(left) s left)"
  timeout $(( $(left) > 200 ? 150 : $(left) - 30 )) python3 -m bench.disagg_bench handoff -m /tmp/models/q06-bf16 \
    --prompt-tokens 1500 --repeats "${HANDOFF_REPEATS:-4}" --max-tokens 16 --out "$1"
}

handoff_suite() {  # issue 24 item 3; each step bounded so the suite fits in about 4 minutes
  if [ "$(left)" -lt 200 ]; then echo "== skip handoff: $(left) s left, needs 200"; return 0; fi
  local out=$RES/handoff w
  echo "== handoff stages ($(left) s left)"
  timeout 60 python3 -m bench.disagg_bench stages --shape qwen3-0.6b --prompt-tokens 1500 --repeats 5 --out "$out"
  for c in ${HANDOFF_WORKERS:-0:0 2:0 2:4 4:4 8:4 4:1}; do  # crypto workers : intake workers
    w=${c%%:*}
    echo "== handoff e2e crypto_workers=$w intake_workers=${c##*:} ($(left) s left)"
    MLXCEL_HANDOFF_INTAKE_WORKERS=${c##*:} timeout 40 python3 -m bench.disagg_bench e2e --shape qwen3-0.6b \
      --prompt-tokens 1500 --repeats 8 --crypto-workers "$w" --suites "${HANDOFF_SUITES:-aes,unprotected}" --out "$out"
  done
  for c in ${HANDOFF_LANE_RUNS:-2:0:0 4:0:0 4:0:4 8:0:4}; do  # lanes : crypto workers : intake workers (docs/disagg.md §4.9)
    echo "== handoff e2e lanes=${c%%:*} crypto_workers=$(echo "$c" | cut -d: -f2) intake_workers=${c##*:} ($(left) s left)"
    MLXCEL_HANDOFF_INTAKE_WORKERS=${c##*:} timeout 40 python3 -m bench.disagg_bench e2e --shape qwen3-0.6b \
      --prompt-tokens 1500 --repeats 8 --lanes "${c%%:*}" --crypto-workers "$(echo "$c" | cut -d: -f2)" \
      --suites "${HANDOFF_SUITES:-aes,unprotected}" --out "$out"
  done
  make_model q06-bf16 || return 0
  one_stream_handoffs "$out"
  grep -h '"bench": "disagg_\(e2e\|handoff\)"' "$out/disagg_bench.jsonl" | python3 -c '
import json, sys
for r in map(json.loads, sys.stdin):
    keys = ("suite", "lanes", "crypto_workers", "topology", "prompt_tokens", "p50_ms", "stream_p50_ms", "stream_gib_s",
            "ttft_ms", "handoff_ms", "handoff_gib_s")
    print({k: r[k] for k in keys if k in r})'
}

profile_suite() {  # issue 24 item 2: where the server's scheduler thread spends a 32-stream step (py-spy samples)
  local out=$RES/profile pid port=18555 spy=${PY_SPY:-/tmp/py-spy}
  [ -x "$spy" ] || { echo "== skip profile: no $spy (carry py-spy in part A)"; return 0; }
  make_model "${PROFILE_MODEL:-q06-bf16}" || return 0
  mkdir -p "$out"
  echo "== profile ${PROFILE_MODEL:-q06-bf16} at 32 streams ($(left) s left)"
  MLXCEL_STEP_TRACE=$out/trace-steps.jsonl python3 -m mlxcel serve -m "/tmp/models/${PROFILE_MODEL:-q06-bf16}" \
    --host 127.0.0.5 --port $port --parallel 32 --max-batch-size 32 > "$out/server.log" 2>&1 &
  pid=$!
  for _ in $(seq 120); do curl -sf 127.0.0.5:$port/health >/dev/null && break; sleep 1; done
  python3 -m bench.serve_bench --url http://127.0.0.5:$port --concurrency 32 --requests "${PROFILE_REQUESTS:-6}" \
    --max-tokens "$TOKENS" --out "$out" > "$out/serve_bench.log" 2>&1 &
  local bench_pid=$!
  sleep 12
  "$spy" record -p $pid -d 12 -r 250 -f raw --threads -o "$out/prof-python.txt" 2>&1 | tail -1
  "$spy" record -p $pid -d 8 -r 100 -f raw --threads --native -o "$out/prof-native.txt" 2>&1 | tail -1
  wait $bench_pid; tail -2 "$out/serve_bench.log" | cut -c1-400
  kill $pid; wait $pid 2>/dev/null
  python3 -m bench.step_trace "$out/trace-steps.jsonl" | head -12
}

handoff_serving() {  # issue 24 item 3: router -> prefill -> decode against one node, long prompts, 1 and 8 streams
  make_model q06-bf16 || return 0
  local out=$RES/handoff
  if [ "${HANDOFF_ONE_STREAM:-1}" = 1 ]; then
    one_stream_handoffs "$out"
    [ "$(left)" -gt 120 ] || return 0
  fi
  echo "== handoff serving, ${HANDOFF_STREAMS:-1,8} streams, q06-bf16 ($(left) s left)"
  timeout $(( $(left) - 20 )) python3 -m bench.disagg_bench serve -m /tmp/models/q06-bf16 \
    --topologies "${HANDOFF_TOPOLOGIES:-hybrid,1p1d-lanes1,1p1d}" \
    --concurrency "${HANDOFF_STREAMS:-1,8}" --long --long-tokens 1500 --requests 2 --rounds "${HANDOFF_ROUNDS:-2}" --max-tokens 32 --out "$out"
}

handoff_profile() {  # issue 24 item 3: where the decode and prefill nodes spend 8-stream handoffs (py-spy)
  local out=$RES/handoff-profile spy=${PY_SPY:-/tmp/py-spy} bench_pid dpid ppid
  [ -x "$spy" ] || { echo "== skip handoff-profile: no $spy (carry py-spy in part A)"; return 0; }
  make_model q06-bf16 || return 0
  mkdir -p "$out"
  echo "== handoff profile, 8 streams, q06-bf16 ($(left) s left)"
  python3 -m bench.disagg_bench serve -m /tmp/models/q06-bf16 --topologies "${PROFILE_TOPOLOGY:-1p1d}" --concurrency 8 \
    --long --long-tokens 1500 --requests "${PROFILE_REQUESTS:-12}" --rounds 1 --max-tokens 32 --out "$out" \
    > "$out/serve.log" 2>&1 &
  bench_pid=$!
  local rpid url n spy_pid
  for _ in $(seq 180); do
    dpid=$(pgrep -f -- "--node-role decode" | head -1); ppid=$(pgrep -f -- "--node-role prefill" | head -1)
    rpid=$(pgrep -f -- "--node-role router" | head -1)
    [ -n "$dpid" ] && [ -n "$ppid" ] && [ -n "$rpid" ] && break; sleep 1
  done
  # the router's own --host/--port: sample once the level's handoffs run (beyond the warm request's one)
  url=$(ps -o args= -p "$rpid" | python3 -c 'import sys; a = sys.stdin.read().split(); print("http://" + a[a.index("--host") + 1] + ":" + a[a.index("--port") + 1])')
  for _ in $(seq 240); do
    n=$(curl -sf "$url/router/stats" | python3 -c 'import json, sys; print(json.load(sys.stdin)["metrics"]["router_handoffs"])' 2>/dev/null)
    [ "${n:-0}" -ge "${PROFILE_AFTER_HANDOFFS:-3}" ] && break; sleep 0.5
  done
  echo "-- sampling after $n handoffs"
  "$spy" record -p "$dpid" -d 8 -r 200 -f raw --threads --idle -o "$out/decode-idle.txt" 2>&1 | tail -1 &
  spy_pid=$!
  "$spy" record -p "$ppid" -d 8 -r 200 -f raw --threads --idle -o "$out/prefill-idle.txt" 2>&1 | tail -1
  wait "$spy_pid"
  "$spy" record -p "$ppid" -d 5 -r 200 -f raw --threads --gil -o "$out/prefill-gil.txt" 2>&1 | tail -1 &
  spy_pid=$!
  "$spy" record -p "$dpid" -d 5 -r 200 -f raw --threads --gil -o "$out/decode-gil.txt" 2>&1 | tail -1
  wait "$spy_pid"
  wait $bench_pid; tail -3 "$out/serve.log" | cut -c1-300
  for f in "$out"/*-idle.txt "$out"/*-gil.txt; do
    for th in scheduler cluster-in intake handoff; do
      echo "-- $(basename "$f") $th"; python3 -m bench.profile_summary "$f" --thread "$th" --top 14 2>&1 | head -32
    done
  done
}

serve_suite() {  # bench/serve_bench.py: mlxcel (async), mlxcel-sync and mlx_lm.server per checkpoint
  local model out
  for model in ${SERVE_MODELS:-q06-q4 q06-bf16}; do
    if [ "$(left)" -lt "${SERVE_BUDGET:-200}" ]; then echo "== skip serve $model: $(left) s left"; continue; fi
    make_model "$model" || continue
    out=$RES/serve-$model
    echo "== serve $model ($(left) s left)"
    python3 -m bench.serve_bench --launch "${SERVE_KINDS:-mlxcel,mlx_lm}" --model-dir "/tmp/models/$model" \
      --concurrency "${SERVE_STREAMS:-1,8,32}" --requests "${SERVE_REQUESTS:-2}" --max-tokens "$TOKENS" --parallel 32 \
      --rounds "${SERVE_ROUNDS:-2}" --warm-levels --gpu-util --step-trace "$out/trace-steps.jsonl" --out "$out" 2>&1 | grep -v "^WARNING"
    for trace in "$out"/trace-steps*.jsonl; do
      [ -s "$trace" ] && echo "-- $(basename "$trace")" && python3 -m bench.step_trace "$trace"
    done
  done
}

main() {
  install
  export PYTHONPATH=/tmp/site:$SRC MLXCEL_GIT_COMMIT=${MLXCEL_GIT_COMMIT:-} PYTHONUNBUFFERED=1
  [ -n "$MLXCEL_GIT_COMMIT" ] || unset MLXCEL_GIT_COMMIT
  # run from a copy outside any git checkout: the device's copy of the session checkout holds a .git,
  # whose commit is not this code's (rows take MLXCEL_GIT_COMMIT instead)
  rm -rf /tmp/src && cp -r "$SRC" /tmp/src && SRC=/tmp/src && export PYTHONPATH=/tmp/site:$SRC
  cd "$SRC"
  python3 -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device())"
  nvidia-smi --query-gpu=name,memory.used,clocks.sm,utilization.gpu --format=csv,noheader
  for s in "$@"; do
    case $s in
      tiny) suite tiny 10 ;;  # a smoke test of this script (CPU or GPU)
      handoff) handoff_suite ;;
      serve) serve_suite ;;
      profile) profile_suite ;;
      handoff-profile) handoff_profile ;;
      handoff-serving) handoff_serving ;;
      serve-tiny) SERVE_MODELS=tiny SERVE_BUDGET=10 serve_suite ;;  # a smoke test of the serve suite
      prefill-probe) make_model q06-bf16 && python3 -m bench.gpu.prefill_probe -m /tmp/models/q06-bf16 \
                       --label h200-q06-bf16 --out "$RES/prefill_probe.jsonl" | tail -40 ;;
      managed-probe) python3 -m bench.gpu.managed_probe --mib 172 --rounds "${PROBE_ROUNDS:-6}" --label h200 \
                       --out "$RES/managed_probe.jsonl" ;;
      pingpong-bf16|pingpong-q4|pingpong-q8b|pingpong-mps-bf16)  # bench/gpu/pingpong_probe.py: two evaluations
        m=${s#pingpong-}; m=${m#mps-}; m=${m/bf16/q06-bf16}; m=${m/#q4/q06-q4}; m=${m/q8b/q8b-q4}  # vs two processes
        label=h200-$m; [ "$s" = pingpong-mps-bf16 ] && { mps_start || continue; label=h200-mps-$m; }
        make_model "$m" && python3 -m bench.gpu.pingpong_probe -m "/tmp/models/$m" --tokens "$TOKENS" \
          --rounds "${PROBE_ROUNDS:-2}" ${PROBE_MODES:+--modes "$PROBE_MODES"} --label "$label" \
          --out "$RES/pingpong_probe.jsonl"
        mps_stop ;;
      protection-bf16|protection-q4|protection-tiny)  # bench/protection_bench.py: protected vs unsealed decode
        m=${s#protection-}; [ "$m" = tiny ] || m=q06-$m
        make_model "$m" && python3 -m bench.pipeline_bench protection -m "/tmp/models/$m" --runs "$RUNS" \
          --tokens "$TOKENS" --label "${LABEL:-h200}-$m" --out "$RES/protection" ;;
      structured-bf16|structured-q4|structured-tiny)  # bench/structured_bench.py: a JSON schema's mask, per token
        m=${s#structured-}; [ "$m" = tiny ] || m=q06-$m
        make_model "$m" && python3 -m bench.structured_bench --model-dir "/tmp/models/$m" \
          --concurrency "${STRUCTURED_STREAMS:-1,32}" --rounds "${STRUCTURED_ROUNDS:-4}" --max-tokens "$TOKENS" \
          --label "${LABEL:-h200}-$m" --out "$RES/structured" ;;
      agent-bf16|agent-q4|agent-tiny)  # bench/agent_turns.py: TTFT per turn of growing agent conversations
        m=${s#agent-}; [ "$m" = tiny ] || m=q06-$m
        variants=(); IFS='|' read -ra picked <<< "${AGENT_VARIANTS:-}"  # NAME=TOPOLOGY;ROLE:ARGS|... (default: the preset)
        for v in "${picked[@]}"; do variants+=(--variant "$v"); done
        make_model "$m" && timeout $(( $(left) > 60 ? $(left) - 30 : 30 )) python3 -m bench.agent_turns \
          -m "/tmp/models/$m" --preset "${AGENT_PRESET:-today}" "${variants[@]}" --prefix-cache-mb "${AGENT_CACHE_MB:-16000}" \
          --conversations 4 --turns "${AGENT_TURNS:-16}" --result-words "${AGENT_WORDS:-270}" \
          --system-words "${AGENT_SYSTEM_WORDS:-300}" --max-tokens 16 \
          --max-prompt-tokens 32768 --repeats "${AGENT_REPEATS:-2}" --label "${LABEL:-h200}-$m" --out "$RES/agent" ;;
      kvbits-bf16)  # bench/decode_bench.py: decode tok/s and KV bytes at 0/8/4 KV bits, long prompts
        make_model q06-bf16 && timeout $(( $(left) > 60 ? $(left) - 30 : 30 )) python3 -m bench.decode_bench \
          -m /tmp/models/q06-bf16 --prompt-tokens ${KV_CONTEXTS:-2048 8192 16384} --kv-bits 0 8 4 --kv-group-size 64 \
          --tokens "$TOKENS" --runs "${KV_RUNS:-3}" --label "${LABEL:-h200}-q06-bf16" \
          --out "$RES/kvbits/decode_bench.jsonl" ;;
      probe-bf16) echo "suite probe-bf16 removed (issue 41: bench/gpu/step_probe.py went with the compiled step)" ;;
      q06-bf16) suite q06-bf16 150 ;;
      q06-q4) suite q06-q4 300 ;;
      q8b-q4) suite q8b-q4 240 ;;
      moe30b-q4) suite moe30b-q4 300 ;;
      ds-q4) suite ds-q4 240 ;;
      *) echo "unknown suite $s" ;;
    esac
  done
  du -sh /tmp/mlx 2>/dev/null
  echo "done in $(( $(date +%s) - T0 )) s"
}

main "$@" 2>&1 | tee "$RES/log.txt"
cp "$RES/log.txt" "$OUT/log.txt"
tar czf "$OUT/results.tar.gz" -C "$RES" .
