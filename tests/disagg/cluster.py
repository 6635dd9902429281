"""A real disaggregated cluster for tests: decode, prefill and router processes started through the CLI.

Each node is ``python -m mlxcel serve --node-role ROLE --serving-bind IP:PORT ...`` on its own
127.0.0.x address, so the transport's identity binding works as on separate hosts; or, with ``Hosts``
naming other addresses and a command prefix, on hosts in network namespaces (``tests/chaos/netns.py``).
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import httpx

from tests.pipeline.cluster import CLI, Node, free_port, write_secret

ROUTER_HOST = "127.0.0.20"
PREFILL_HOSTS = ("127.0.0.21", "127.0.0.22")
DECODE_HOSTS = ("127.0.0.23", "127.0.0.24", "127.0.0.25")
FAST = ("--no-warmup", "--parallel", "2", "--max-queue", "4")


@dataclass(frozen=True)
class Hosts:
    """Where a cluster's processes run: their addresses, a free port on one, the command prefix that runs there.

    ``router`` is the router's cluster address; ``router_http`` its OpenAI port's (loopback: a router
    listening elsewhere wants an API key)."""

    router: str = ROUTER_HOST
    router_http: str = ROUTER_HOST
    prefills: tuple[str, ...] = PREFILL_HOSTS
    decodes: tuple[str, ...] = DECODE_HOSTS
    port: Callable[[str], int] = free_port
    prefix: Callable[[str], list[str]] = lambda host: []


LOOPBACK = Hosts()


class RoleNode(Node):
    """One role process (``tests.pipeline.cluster.Node`` with role flags instead of a TOML)."""

    def __init__(self, model: Path, role: str, host: str, bind: str, secret: Path, *flags: str,
                 env: dict | None = None, prefix: list[str] | None = None):
        self.role, self.bind, self.host = role, bind, host
        self._args = (model, role, host, bind, secret, flags, env, prefix or [])
        self._start()

    def _start(self) -> None:
        model, role, host, bind, secret, flags, env, prefix = self._args
        cmd = [*prefix, *CLI, "-m", str(model), "--node-role", role, "--serving-bind", bind, "--cluster-secret-file",
               str(secret), "--host", host, "--port", "0", "--served-model-name", "tiny", "--log-level", "info",
               *flags]
        self.node_id = f"{role}@{bind}"
        self._spawn(cmd, env)

    def restart(self) -> "RoleNode":
        self._start()
        self.wait_ready()
        return self

    def state(self) -> dict:
        return self.health().json()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)


class DisaggCluster:
    """A router over ``prefills`` prefill and ``decodes`` decode nodes of ``model``; start order decode, prefill, router."""

    def __init__(self, tmp: Path, model: Path, *, prefills: int = 1, decodes: int = 1,
                 router_flags: tuple[str, ...] = (), node_flags: tuple[str, ...] = FAST,
                 prefill_flags: tuple[str, ...] = (), prefill_env: dict | None = None,
                 decode_env: dict | None = None, router_env: dict | None = None, hosts: Hosts = LOOPBACK):
        self.tmp, self.model, self.hosts = tmp, model, hosts
        self.secret = write_secret(tmp)
        self.router_addr = f"{hosts.router}:{hosts.port(hosts.router)}"
        self.prefill_addrs = [f"{h}:{hosts.port(h)}" for h in hosts.prefills[:prefills]]
        self.decode_addrs = [f"{h}:{hosts.port(h)}" for h in hosts.decodes[:decodes]]
        self.router_flags, self.node_flags = router_flags, node_flags
        self.prefill_flags = prefill_flags
        self.prefill_env, self.decode_env, self.router_env = prefill_env, decode_env, router_env
        self.prefills: list[RoleNode] = []
        self.decodes: list[RoleNode] = []
        self.router: RoleNode | None = None

    def start(self) -> "DisaggCluster":
        try:
            h = self.hosts
            for i, addr in enumerate(self.decode_addrs):
                self.decodes.append(RoleNode(self.model, "decode", h.decodes[i], addr, self.secret, *self.node_flags,
                                             env=self.decode_env, prefix=h.prefix(h.decodes[i])))
            for i, addr in enumerate(self.prefill_addrs):
                self.prefills.append(RoleNode(self.model, "prefill", h.prefills[i], addr, self.secret,
                                              "--decode-peers", self.decode_addrs[0], *self.node_flags,
                                              *self.prefill_flags, env=self.prefill_env,
                                              prefix=h.prefix(h.prefills[i])))
            for node in (*self.decodes, *self.prefills):
                node.wait_ready()
            self.router = RoleNode(self.model, "router", h.router_http, self.router_addr, self.secret,
                                   "--prefill-peers", ",".join(self.prefill_addrs), "--decode-peers",
                                   ",".join(self.decode_addrs), "--probe-interval", "0.3", *self.router_flags,
                                   env=self.router_env, prefix=h.prefix(h.router))
            self.router.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def url(self) -> str:
        assert self.router is not None
        return self.router.url

    def stats(self) -> dict:
        return httpx.get(f"{self.url}/router/stats", timeout=5).json()

    def node_status(self, node_id: str) -> str:
        return next(n["status"] for n in self.stats()["nodes"] if n["id"] == node_id)

    def wait_status(self, node_id: str, status: str, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.node_status(node_id) == status:
                return
            time.sleep(0.1)
        raise AssertionError(f"{node_id} did not become {status}: {self.stats()}")

    def stop(self) -> None:
        for node in [self.router, *self.prefills, *self.decodes]:
            if node is not None:
                node.stop()


def wait_for(predicate, timeout: float = 20, what: str = "condition"):
    """``predicate()``'s first truthy value, polled every 50 ms; AssertionError naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")
