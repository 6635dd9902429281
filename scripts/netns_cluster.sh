#!/usr/bin/env bash
# Simulated hosts for the Ansible deployment: one network namespace per host, joined by a bridge, each
# running its own sshd, so Ansible reaches them over real SSH on their own addresses. Needs root.
#
#   sudo bash scripts/netns_cluster.sh up                # namespaces, bridge, sshds; writes the inventory
#   ansible-playbook deploy.yml -i examples/netns/inventory
#   sudo bash scripts/netns_cluster.sh cut stage-1       # take a host's link down (ip link set ... down)
#   sudo bash scripts/netns_cluster.sh restore stage-1   # and up again
#   sudo bash scripts/netns_cluster.sh down              # stop everything in the namespaces, delete them
#   sudo bash scripts/netns_cluster.sh run -- CMD...     # up, CMD, down (down also on failure or Ctrl-C)
#
# Hosts: coordinator 10.232.N.2, stage-0 10.232.N.3, stage-1 10.232.N.4, ...; the bridge (this machine,
# the Ansible controller) is 10.232.N.1. N is MLXCEL_NETNS_ID (default 0), so several clusters can
# coexist; MLXCEL_NETNS_STAGES sets the number of stages (default 2). State (SSH keys, sshd configs,
# known_hosts, the generated inventory, the hosts' mlxcel directories) lives in
# ${MLXCEL_NETNS_DIR:-.mlxcel/netns/N}. The filesystem is shared: every host uses this checkout's .venv.
# `up` installs openssh-server with apt-get when sshd is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
ID=${MLXCEL_NETNS_ID:-0}
STAGES=${MLXCEL_NETNS_STAGES:-2}
STATE=${MLXCEL_NETNS_DIR:-$REPO/.mlxcel/netns/$ID}
SUBNET=10.232.$ID
BRIDGE=mlxbr$ID
NODES=(coordinator)
for ((i = 0; i < STAGES; i++)); do NODES+=("stage-$i"); done

ns_name() { echo "mlxcel-$ID-$1"; }                 # namespace of a node
host_link() { echo "mlxv$ID${1//[^0-9c]/}"; }       # bridge-side veth (at most 15 characters)
address() {                                         # a node's address: .2 for the coordinator, .3+ for stages
  if [ "$1" = coordinator ]; then echo "$SUBNET.2"; else echo "$SUBNET.$((3 + ${1#stage-}))"; fi
}

need_root() { [ "$(id -u)" = 0 ] || { echo "netns_cluster.sh: needs root (ip netns, sshd)" >&2; exit 1; }; }

ensure_sshd() {
  if [ ! -x /usr/sbin/sshd ]; then
    echo "==> installing openssh-server"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssh-server >/dev/null ||
      { apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssh-server >/dev/null; }
  fi
  mkdir -p /run/sshd
}

write_sshd_config() {  # node address
  cat > "$STATE/sshd-$1.conf" <<EOF
ListenAddress $2
Port 22
HostKey $STATE/host-$1
PidFile $STATE/sshd-$1.pid
AuthorizedKeysFile $STATE/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
ClientAliveInterval 5
ClientAliveCountMax 3
MaxStartups 50
MaxSessions 50
Subsystem sftp internal-sftp
EOF
}

write_inventory() {
  {
    echo "# Written by scripts/netns_cluster.sh up (MLXCEL_NETNS_ID=$ID): hosts in network namespaces, over SSH."
    echo "mlxcel_cluster:"
    echo "  vars:"
    echo "    ansible_connection: ssh"
    echo "    ansible_user: root"
    echo "    ansible_ssh_private_key_file: $STATE/id_ed25519"
    echo "    ansible_ssh_common_args: -o UserKnownHostsFile=$STATE/known_hosts -o StrictHostKeyChecking=yes"
    echo "    ansible_python_interpreter: $REPO/.venv/bin/python"
    echo "    mlxcel_state_root: $STATE/hosts"
    echo "    mlxcel_home: \"{{ mlxcel_state_root }}/{{ mlxcel_node_id }}\""
    echo "    mlxcel_install_method: reuse"
    echo "    mlxcel_venv: $REPO/.venv"
    echo "    mlxcel_model_dir: \"{{ mlxcel_model_source }}\""
    echo "    mlxcel_node_supervisor: pidfile"
    echo "    mlxcel_api_key_enabled: true"
    echo "    mlxcel_bench_workdir: $REPO"
    echo "  children:"
    echo "    coordinator:"
    echo "      hosts:"
    echo "        ns-coordinator: {ansible_host: $(address coordinator), mlxcel_node_id: coordinator}"
    echo "    stages:"
    echo "      hosts:"
    for node in "${NODES[@]:1}"; do
      echo "        ns-$node: {ansible_host: $(address "$node"), mlxcel_node_id: $node}"
    done
  } > "$STATE/inventory.yml"
}

up() {
  need_root
  ensure_sshd
  mkdir -p "$STATE/hosts"
  chmod 700 "$STATE"
  [ -f "$STATE/id_ed25519" ] || ssh-keygen -q -t ed25519 -N "" -C "mlxcel-netns-$ID" -f "$STATE/id_ed25519"
  cp "$STATE/id_ed25519.pub" "$STATE/authorized_keys"
  : > "$STATE/known_hosts"
  ip link add "$BRIDGE" type bridge
  ip addr add "$SUBNET.1/24" dev "$BRIDGE"
  ip link set "$BRIDGE" up
  for node in "${NODES[@]}"; do
    local ns link addr
    ns=$(ns_name "$node") link=$(host_link "$node") addr=$(address "$node")
    ip netns add "$ns"
    ip link add "$link" type veth peer name eth0 netns "$ns"
    ip link set "$link" master "$BRIDGE" up
    ip -n "$ns" addr add "$addr/24" dev eth0
    ip -n "$ns" link set lo up
    ip -n "$ns" link set eth0 up
    [ -f "$STATE/host-$node" ] || ssh-keygen -q -t ed25519 -N "" -f "$STATE/host-$node"
    write_sshd_config "$node" "$addr"
    ip netns exec "$ns" /usr/sbin/sshd -f "$STATE/sshd-$node.conf" -E "$STATE/sshd-$node.log"
    echo "$addr $(cut -d' ' -f1,2 "$STATE/host-$node.pub")" >> "$STATE/known_hosts"
  done
  for node in "${NODES[@]}"; do   # every sshd answers before we hand the cluster over
    local addr ok=""
    addr=$(address "$node")
    for _ in $(seq 100); do
      if ssh -q -i "$STATE/id_ed25519" -o UserKnownHostsFile="$STATE/known_hosts" -o StrictHostKeyChecking=yes \
           -o BatchMode=yes -o ConnectTimeout=2 "root@$addr" true 2>/dev/null; then ok=1; break; fi
      sleep 0.1
    done
    [ -n "$ok" ] || { echo "netns_cluster.sh: sshd of $node ($addr) does not answer; see $STATE/sshd-$node.log" >&2; exit 1; }
  done
  write_inventory
  echo "==> ${#NODES[@]} hosts up: $(for n in "${NODES[@]}"; do printf '%s=%s ' "$n" "$(address "$n")"; done)"
  echo "    inventory: $STATE/inventory.yml"
}

down() {
  set +e
  for node in "${NODES[@]}"; do
    local ns
    ns=$(ns_name "$node")
    if ip netns list | grep -qw "$ns"; then
      for pid in $(ip netns pids "$ns"); do kill -TERM "$pid" 2>/dev/null; done
      sleep 0.5
      for pid in $(ip netns pids "$ns"); do kill -KILL "$pid" 2>/dev/null; done
      ip netns del "$ns"
    fi
    ip link del "$(host_link "$node")" 2>/dev/null
    rm -f "$STATE/sshd-$node.pid"
  done
  ip link del "$BRIDGE" 2>/dev/null
  rm -f "$STATE/inventory.yml"
  return 0
}

link() {  # up|down node
  need_root
  local node=$2
  [[ " ${NODES[*]} " == *" $node "* ]] || { echo "netns_cluster.sh: no host '$node' (hosts: ${NODES[*]})" >&2; exit 2; }
  ip link set "$(host_link "$node")" "$1"
  echo "==> $node ($(address "$node")): link $1"
}

case "${1:-}" in
  up) trap 'down' ERR INT TERM; up ;;
  down) need_root; down ;;
  cut) link down "${2:?usage: netns_cluster.sh cut NODE}" ;;
  restore) link up "${2:?usage: netns_cluster.sh restore NODE}" ;;
  run)
    shift; [ "${1:-}" = "--" ] && shift
    trap 'down' EXIT INT TERM
    up
    "$@"
    ;;
  *) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
