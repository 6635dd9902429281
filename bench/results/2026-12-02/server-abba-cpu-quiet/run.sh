#!/usr/bin/env bash
# The driver of these rows: scripts/serve.sh's deployment against one mlxcel-server, serve_bench at 1/4/8
# streams, order S C C S C S S C (two ABBA rounds). The recorded run was `bash run.sh /tmp/fresh /tmp/abba-out`
# (a fresh clone of main 1e39ad8 after `bash scripts/serve.sh`); it then tore the cluster down by hand,
# which the last line now does.
#   bash run.sh [REPO (default: this checkout)] [OUT (default /tmp/abba-out)]
set -u
cd "${1:-$(git -C "$(dirname "$0")" rev-parse --show-toplevel)}"
OUT=${2:-/tmp/abba-out}; rm -rf "$OUT"; mkdir -p "$OUT"
.venv/bin/ansible-playbook deploy.yml -i inventory -e '{"mlxcel_node_server_args": ["--parallel","8","--max-batch-size","8"]}' > "$OUT/deploy.log" 2>&1 || { echo deploy failed; exit 1; }
.venv/bin/mlxcel-server -m models/smollm2-135m-instruct --host 127.0.0.1 --port 8099 --parallel 8 --max-batch-size 8 > "$OUT/single.log" 2>&1 &
SP=$!
for i in $(seq 60); do curl -sf http://127.0.0.1:8099/health >/dev/null && break; sleep 1; done
run() { .venv/bin/python -m bench.serve_bench --url "$2" --concurrency 1,4,8 --requests 2 --max-tokens 48 --ignore-eos --rounds 1 --label "$1" --out "$OUT/$1-$3" > "$OUT/$1-$3.txt" 2>&1; }
S=http://127.0.0.1:8099; C=http://127.0.0.2:8080
run single $S 1; run cluster $C 1; run cluster $C 2; run single $S 2
run cluster $C 3; run single $S 3; run single $S 4; run cluster $C 4
kill $SP; wait $SP
.venv/bin/ansible-playbook teardown.yml -i inventory > "$OUT/teardown.log" 2>&1
echo done
