#!/usr/bin/env bash
# Frame benchmark between two "hosts": two network namespaces joined by a veth pair, so the
# echo peer and the client have distinct IPs on a real (virtual) Ethernet link instead of loopback.
# Needs root (ip netns). Creates mlxcel-fb-a-<pid>/mlxcel-fb-b-<pid> and removes them on exit, whatever happens.
#   sudo bash bench/netns_frame_bench.sh [frame_bench options, e.g. --quick --suites unprotected,aes]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
A=mlxcel-fb-a-$$ B=mlxcel-fb-b-$$
VA=mxfa$$ VB=mxfb$$   # link names: at most 15 characters
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
  ip link del "$VA" 2>/dev/null || true   # only still here if it never moved into a namespace
  ip netns del "$A" 2>/dev/null || true
  ip netns del "$B" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT INT TERM

ip netns add "$A"
ip netns add "$B"
ip link add $VA type veth peer name $VB
ip link set $VA netns "$A"
ip link set $VB netns "$B"
ip -n "$A" addr add "$IP_A/24" dev $VA
ip -n "$B" addr add "$IP_B/24" dev $VB
for ns in "$A" "$B"; do ip -n "$ns" link set lo up; done
ip -n "$A" link set $VA up
ip -n "$B" link set $VB up

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
