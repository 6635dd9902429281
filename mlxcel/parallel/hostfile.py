"""The multi-host hostfile (``--tp-hostfile``): mlx.launch's JSON format, and the loopback rule.

    {"backend": "ring", "hosts": [{"ssh": "a", "ips": ["127.0.0.1"]}, {"ssh": "b", "ips": ["127.0.0.1"]}]}

(or just the ``hosts`` list). Host i is rank i. As with ``mlx.launch --backend ring``, every IP of
every host gets one ring port, counted up from the starting port (``--tp-port``) in host order; rank
0's control channel listens on rank 0's first IP at the port after the last ring port. ``ssh`` and
``rdma`` are accepted and ignored: each rank is started by the operator, not over ssh.

MLX's collectives carry tensors as plain, unauthenticated TCP, so every IP must be loopback unless
the operator opts in with ``--tp-allow-plaintext-network``.
"""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass
from pathlib import Path

from mlxcel.config import TP_MAX_HOSTS
from mlxcel.parallel.errors import HostfileError

PLAINTEXT_FLAG = "--tp-allow-plaintext-network"
PLAINTEXT_WHY = ("MLX's collectives carry tensors over plain, unauthenticated TCP, so tensor parallelism "
                 "binds loopback only")


@dataclass(frozen=True)
class Hostfile:
    """Ranks' IPs in rank order, and the backend the file names (or "")."""

    path: Path
    ips: tuple[tuple[str, ...], ...]
    backend: str = ""

    @property
    def size(self) -> int:
        return len(self.ips)

    def ring_addresses(self, first_port: int) -> list[list[str]]:
        """MLX_HOSTFILE's content for the ring backend: per rank, ``ip:port`` for each of its IPs."""
        port, out = first_port, []
        for ips in self.ips:
            node = []
            for ip in ips:
                node.append(f"{_bracket(ip)}:{port}")
                port += 1
            out.append(node)
        return out

    def control_address(self, first_port: int) -> tuple[str, int]:
        """Rank 0's control listener: its first IP, the port after the last ring port."""
        return self.ips[0][0], first_port + sum(len(ips) for ips in self.ips)

    def non_loopback(self) -> list[tuple[int, str]]:
        return [(rank, ip) for rank, ips in enumerate(self.ips) for ip in ips
                if not ipaddress.ip_address(ip).is_loopback]


def _bracket(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip


def _host_ips(host: object, rank: int, path: Path) -> tuple[str, ...]:
    if not isinstance(host, dict):
        raise HostfileError(f"{path}: host {rank} must be an object like {{\"ssh\": \"name\", \"ips\": [\"10.0.0.1\"]}}")
    ips = host.get("ips")
    if not isinstance(ips, list) or not ips:
        raise HostfileError(f"{path}: host {rank} has no \"ips\"; the ring backend needs an IP address per rank")
    for ip in ips:
        try:
            ipaddress.ip_address(ip)
        except (ValueError, TypeError):
            raise HostfileError(f"{path}: host {rank}: {ip!r} is not an IP address") from None
    return tuple(ips)


def parse_hostfile(text: str, path: Path) -> Hostfile:
    """Parse mlx.launch's hostfile JSON; ``HostfileError`` names the first problem."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise HostfileError(f"{path}: not JSON ({exc})") from None
    backend = ""
    if isinstance(data, dict):
        backend = data.get("backend", "") or ""
        if not isinstance(backend, str):
            raise HostfileError(f"{path}: \"backend\" must be a string")
        data = data.get("hosts")
    if not isinstance(data, list) or not data:
        raise HostfileError(f"{path}: expected a non-empty list of hosts (or an object with \"hosts\")")
    if len(data) > TP_MAX_HOSTS:
        raise HostfileError(f"{path}: {len(data)} hosts, at most {TP_MAX_HOSTS}")
    return Hostfile(path, tuple(_host_ips(h, i, path) for i, h in enumerate(data)), backend)


def load_hostfile(path: str | Path, size: int, *, allow_plaintext: bool) -> Hostfile:
    """Read, check the rank count and the loopback rule; one line per refusal."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise HostfileError(f"cannot read --tp-hostfile {path}: {exc.strerror or exc}") from None
    hosts = parse_hostfile(text, path)
    if hosts.size != size:
        raise HostfileError(f"{path} lists {hosts.size} hosts but --tp-size is {size}: one host per rank")
    check_loopback(hosts, allow_plaintext=allow_plaintext)
    return hosts


def check_loopback(hosts: Hostfile, *, allow_plaintext: bool) -> None:
    """Refuse non-loopback addresses unless the operator opted in."""
    outside = hosts.non_loopback()
    if outside and not allow_plaintext:
        named = ", ".join(f"{ip} (rank {rank})" for rank, ip in outside)
        raise HostfileError(f"{hosts.path} names non-loopback addresses {named}: {PLAINTEXT_WHY}; "
                            f"pass {PLAINTEXT_FLAG} to accept that risk")
