"""A real pipeline cluster for tests: stage and coordinator processes on their own loopback addresses.

Every node is ``python -m mlxcel serve --distributed-config F --node-id ID`` on 127.0.0.x, so the
transport's identity binding (source IP = advertised IP) is exercised as on separate hosts.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from tests.ports import free_port  # noqa: F401  (re-exported to the cluster tests)
from tests.server.util import stop_process

CLI = [sys.executable, "-m", "mlxcel", "serve"]
_URL = re.compile(r"(?:serving \S+ on |health on )(http://[\d.]+:\d+)")
COORDINATOR_HOST = "127.0.0.2"
STAGE_HOSTS = ("127.0.0.3", "127.0.0.4", "127.0.0.5")


def write_secret(tmp: Path) -> Path:
    """A fresh random cluster secret in ``tmp/cluster.secret``, mode 0600."""
    secret = tmp / "cluster.secret"
    secret.write_text(os.urandom(32).hex() + "\n")
    secret.chmod(0o600)
    return secret


class Node:
    """One cluster process; ``url`` is its HTTP address once it listens, stderr kept in ``lines``."""

    #: how long a started process may take to print its URL, and then to be ready (a test starting many
    #: at once raises them)
    start_wait_s = 60.0
    ready_wait_s = 60.0

    def __init__(self, model: Path, toml: Path, node_id: str, host: str, *flags: str, env: dict | None = None):
        cmd = [*CLI, "-m", str(model), "--distributed-config", str(toml), "--node-id", node_id,
               "--host", host, "--port", "0", "--served-model-name", "tiny", "--log-level", "info", *flags]
        self.node_id = node_id
        self._spawn(cmd, env)

    def _spawn(self, cmd: list[str], env: dict | None) -> None:
        """Start ``cmd`` and wait up to ``start_wait_s`` for the URL on its stderr; stop it and raise if none comes."""
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                                     env={**os.environ, **(env or {})})
        self.lines: list[str] = []
        self.url = ""
        self._listening = threading.Event()
        threading.Thread(target=self._drain, daemon=True).start()
        if not self._listening.wait(self.start_wait_s):
            self.stop()
            raise RuntimeError(f"{self.node_id} did not start:\n" + "".join(self.lines))

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)
            m = _URL.search(line)
            if m and not self.url:
                self.url = m.group(1)
                self._listening.set()
        self._listening.set()

    def health(self) -> httpx.Response:
        return httpx.get(f"{self.url}/health", timeout=5)

    def wait_ready(self, timeout: float | None = None) -> None:
        deadline = time.monotonic() + (self.ready_wait_s if timeout is None else timeout)
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.node_id} exited:\n" + "".join(self.lines))
            try:
                if self.health().status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{self.node_id} not ready:\n" + "".join(self.lines))

    def stop(self, sig: int = signal.SIGINT) -> int:
        return stop_process(self.proc, sig)


class LocalCluster:
    """A coordinator and N stages of ``model``; ``start()`` brings them up in order (stages first)."""

    def __init__(self, tmp: Path, model: Path, *, stages: int = 2, layers: list[str] | None = None,
                 timeouts: str = "heartbeat_s = 0.5\nexchange_s = 10\nstartup_s = 60",
                 coordinator_flags: tuple[str, ...] = (), stage_delay: float = 0.0, pipeline: str = ""):
        self.tmp, self.model = tmp, model
        self.secret = write_secret(tmp)
        self.coordinator_addr = f"{COORDINATOR_HOST}:{free_port(COORDINATOR_HOST)}"
        self.stage_addrs = [f"{STAGE_HOSTS[i]}:{free_port(STAGE_HOSTS[i])}" for i in range(stages)]
        self.toml = tmp / "cluster.toml"
        self.toml.write_text(self.render(layers, timeouts, pipeline))
        self.coordinator_flags = coordinator_flags
        self.stage_env = {"MLXCEL_TEST_STAGE_STEP_DELAY_S": str(stage_delay)} if stage_delay else None
        self.stages: list[Node] = []
        self.coordinator: Node | None = None

    def render(self, layers: list[str] | None, timeouts: str, pipeline: str = "") -> str:
        text = (f'[cluster]\nname = "test-cluster"\npipeline_parallel_size = {len(self.stage_addrs)}\n'
                f'secret_file = "{self.secret.name}"\n\n[pipeline]\n{pipeline}\n\n[timeouts]\n{timeouts}\n\n'
                f'[[nodes]]\nid = "coordinator"\nrole = "coordinator"\naddress = "{self.coordinator_addr}"\n')
        for i, addr in enumerate(self.stage_addrs):
            text += f'\n[[nodes]]\nid = "stage-{i}"\nrole = "stage"\naddress = "{addr}"\n'
            if layers:
                text += f'layers = "{layers[i]}"\n'
        return text

    def start_stage(self, i: int) -> Node:
        node = Node(self.model, self.toml, f"stage-{i}", STAGE_HOSTS[i], env=self.stage_env)
        node.wait_ready()
        if i < len(self.stages):
            self.stages[i] = node
        else:
            self.stages.append(node)
        return node

    def start(self) -> "LocalCluster":
        for i in range(len(self.stage_addrs)):
            self.start_stage(i)
        self.coordinator = Node(self.model, self.toml, "coordinator", COORDINATOR_HOST, *self.coordinator_flags)
        self.coordinator.wait_ready()
        return self

    @property
    def url(self) -> str:
        assert self.coordinator is not None
        return self.coordinator.url

    def stop(self) -> None:
        for node in [self.coordinator, *self.stages]:
            if node is not None:
                node.stop()
