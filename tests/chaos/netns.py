"""Hosts in network namespaces for a test: one namespace per host, joined by a bridge in a hub namespace.

``Lab(hosts)`` creates, on 10.233.N.0/24 (N a free subnet): a hub namespace holding bridge ``br0``;
per host a namespace whose ``eth0`` (10.233.N.(10+i)) is one end of a veth pair, the other end
(``h<i>``) on the bridge; and one veth pair into the host namespace (``lcN``, 10.233.N.1, the only
interface the lab adds to this machine's own namespace) so that the test process, and what it runs
there (a router), reach every host. Nothing is routed or bridged off the machine. A host's link is
cut by setting its bridge-side end down (the host sees no carrier; packets either way are dropped,
as with a pulled cable) and restored by setting it up. ``close()`` ends every process still in the
namespaces (by pid, ``ip netns pids``) and deletes them, which deletes their veth pairs.

Needs root and ``ip netns``; ``unusable()`` says why not, for a skip.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

SUBNETS = "10.233"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")
    return result


def unusable() -> str | None:
    """Why a lab cannot be built here (None when it can): not root, no ``ip``, or ``ip netns add`` fails."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is missing"
    probe = f"lcprobe{os.getpid()}"
    added = _ip("netns", "add", probe, check=False)
    _ip("netns", "del", probe, check=False)
    return None if added.returncode == 0 else f"ip netns add fails here: {added.stderr.strip()}"


def _free_subnet() -> int:
    """A third octet N whose 10.233.N.0/24 no route and no namespace of this kind uses yet."""
    routes = _ip("-4", "route", "show", "table", "all").stdout
    spaces = _ip("netns", "list").stdout
    for n in [(os.getpid() + k) % 250 + 1 for k in range(250)]:
        if f"{SUBNETS}.{n}." not in routes and f"lc{n}-" not in spaces:
            return n
    raise RuntimeError(f"no free {SUBNETS}.N.0/24 subnet")


class Lab:
    """``hosts`` namespaced hosts (0-based), their addresses in ``addresses``, plus this machine at ``gateway``."""

    def __init__(self, hosts: int):
        self.n = _free_subnet()
        self.hub = f"lc{self.n}-hub"
        self.spaces = [f"lc{self.n}-{i}" for i in range(hosts)]
        self.gateway = f"{SUBNETS}.{self.n}.1"
        self.addresses = [f"{SUBNETS}.{self.n}.{10 + i}" for i in range(hosts)]
        self.host_link = f"lc{self.n}"
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        _ip("netns", "add", self.hub)
        _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.hub, "link", "set", "br0", "up")
        _ip("link", "add", self.host_link, "type", "veth", "peer", "name", "gw", "netns", self.hub)
        self._attach(self.hub, "gw")
        subprocess.run(["sysctl", "-qw", f"net.ipv6.conf.{self.host_link}.disable_ipv6=1"], capture_output=True)
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.host_link)
        _ip("link", "set", self.host_link, "up")
        for i, (space, address) in enumerate(zip(self.spaces, self.addresses)):
            _ip("netns", "add", space)
            _ip("-n", self.hub, "link", "add", f"h{i}", "type", "veth", "peer", "name", "eth0", "netns", space)
            self._attach(self.hub, f"h{i}")
            _ip("-n", space, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", space, "link", "set", "lo", "up")
            _ip("-n", space, "link", "set", "eth0", "up")

    @staticmethod
    def _attach(hub: str, link: str) -> None:
        _ip("-n", hub, "link", "set", link, "master", "br0")
        _ip("-n", hub, "link", "set", link, "up")

    def prefix(self, i: int) -> list[str]:
        """The command prefix that runs a program on host ``i``."""
        return ["ip", "netns", "exec", self.spaces[i]]

    def link(self, i: int, up: bool) -> None:
        """Cut (``up=False``) or restore host ``i``'s link: its bridge-side veth end down or up."""
        _ip("-n", self.hub, "link", "set", f"h{i}", "up" if up else "down")

    def close(self) -> None:
        """End the processes left in the namespaces (SIGKILL by pid), then delete the namespaces and links."""
        for space in [*self.spaces, self.hub]:
            pids = _ip("netns", "pids", space, check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if pids:
                time.sleep(0.2)
            _ip("netns", "del", space, check=False)
        _ip("link", "del", self.host_link, check=False)  # gone with the hub already; a half-built lab may differ
