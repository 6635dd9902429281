#!/usr/bin/env bash
# Frame benchmark between two "hosts": two network namespaces joined by a veth pair, so the
# echo peer and the client have distinct IPs on a real (virtual) Ethernet link instead of loopback.
# Needs root (ip netns). Creates mlxcel-bench-a/b and removes them on exit, whatever happens.
#   sudo bash bench/netns_frame_bench.sh [frame_bench options, e.g. --quick --suites unprotected,aes]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
A=mlxcel-bench-a B=mlxcel-bench-b
IP_A=10.231.0.1 IP_B=10.231.0.2 PORT=19100
work=$(mktemp -d)
echo_pid=""
cleanup() {
  set +e
  exec 3>&-
  if [ -n "$echo_pid" ]; then
    kill "$echo_pid" 2>/dev/null
    wait "$echo_pid" 2>/dev/null
  fi
  ip netns del "$A" 2>/dev/null || true
  ip netns del "$B" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT INT TERM

ip netns add "$A"
ip netns add "$B"
ip link add mlxcel-va type veth peer name mlxcel-vb
ip link set mlxcel-va netns "$A"
ip link set mlxcel-vb netns "$B"
ip -n "$A" addr add "$IP_A/24" dev mlxcel-va
ip -n "$B" addr add "$IP_B/24" dev mlxcel-vb
for ns in "$A" "$B"; do ip -n "$ns" link set lo up; done
ip -n "$A" link set mlxcel-va up
ip -n "$B" link set mlxcel-vb up

secret="$work/cluster.secret"
(umask 077; head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$secret")

# The echo peer runs until its stdin closes: hold a FIFO open on fd 3 for it.
mkfifo "$work/stdin"
exec 3<>"$work/stdin"
ip netns exec "$B" "$PY" -m bench.frame_bench --serve-echo "$IP_B:$PORT" --cluster-secret-file "$secret" \
  < "$work/stdin" > "$work/echo.log" 2>&1 &
echo_pid=$!
for _ in $(seq 50); do grep -q . "$work/echo.log" 2>/dev/null && break; sleep 0.2; done
ip netns exec "$A" "$PY" -m bench.frame_bench --remote "$IP_B:$PORT" --advertise "$IP_A" \
  --cluster-secret-file "$secret" "$@"
