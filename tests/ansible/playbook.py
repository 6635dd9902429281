"""Run the repository's playbooks against the loopback inventory in a private state directory.

Every run gets its own per-host and controller directories, a tiny random checkpoint and ports that
are free on 127.0.0.2-4, so tests never touch a real deployment under .mlxcel/ or its ports.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.ports import free_port  # noqa: F401  (re-exported to the Ansible tests)

REPO = Path(__file__).resolve().parents[2]
ANSIBLE_PLAYBOOK = REPO / ".venv" / "bin" / "ansible-playbook"
HOSTS = {"coordinator": "127.0.0.2", "stage-0": "127.0.0.3", "stage-1": "127.0.0.4"}
SPARE_ADDRESS = "127.0.0.5"  # a fourth host (the disaggregated cluster's second decode node): its ports are free too
_RECAP = re.compile(r"^(\S+)\s+: ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)", re.M)


@dataclass
class Result:
    rc: int
    output: str
    seconds: float

    def recap(self) -> dict[str, dict[str, int]]:
        """PLAY RECAP counters per host."""
        return {m[1]: {"ok": int(m[2]), "changed": int(m[3]), "unreachable": int(m[4]), "failed": int(m[5])}
                for m in _RECAP.finditer(self.output)}


@dataclass
class Deployment:
    """One private loopback cluster: where its state lives and how to run playbooks on it."""

    root: Path
    model: Path
    http_port: int
    cluster_port: int
    extra: dict = field(default_factory=dict)
    # the nodes whose supervisor keeps a warm standby (docs/deploy.md, "The warm standby"): only where a test kills
    # one; every other node runs with [restart] standby = false, since a standby that no restart uses costs a few
    # seconds of CPU (its imports) on a box the whole suite shares
    standbys: tuple[str, ...] = ()

    @property
    def state(self) -> Path:
        return self.root / "state"

    @property
    def controller(self) -> Path:
        return self.root / "controller"

    @property
    def url(self) -> str:
        return f"http://{HOSTS['coordinator']}:{self.http_port}"

    def home(self, node: str) -> Path:
        return self.state / node

    def variables(self, **more: object) -> dict:
        return {"mlxcel_state_root": str(self.state), "mlxcel_controller_dir": str(self.controller),
                "mlxcel_model_source": str(self.model), "mlxcel_http_port": self.http_port,
                "mlxcel_cluster_port": self.cluster_port, "mlxcel_node_health_timeout_s": 90,
                "mlxcel_node_restart": self._restart(), **self.extra, **more}

    def _restart(self) -> str:
        """mlxcel_node_restart per host (an extra variable is templated for each host): the engine's defaults for
        the nodes in ``standbys``, no standby for the others."""
        return "{{ {} if mlxcel_node_id in %s else {'standby': false} }}" % json.dumps(list(self.standbys))

    def run(self, playbook: str, *args: str, inventory: str = "inventory", timeout: float = 480,
            **more: object) -> Result:
        """ansible-playbook PLAYBOOK -i INVENTORY -e <this deployment's variables> ARGS, from the repository root."""
        cmd = [str(ANSIBLE_PLAYBOOK), playbook, "-i", inventory, "-e", json.dumps(self.variables(**more)), *args]
        env = {**os.environ, "ANSIBLE_NOCOLOR": "1", "ANSIBLE_FORCE_COLOR": "0", "PYTHONUNBUFFERED": "1"}
        start = time.monotonic()
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        return Result(proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start)

    def pids(self) -> list[int]:
        """Live processes of this deployment: any whose command line names its state directory."""
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if str(self.state) in cmdline and state != "Z":
                found.append(int(entry.name))
        return found

    def kill_leftovers(self) -> None:
        """Last resort after a failed test: end this deployment's processes (by pid)."""
        for pid in self.pids():
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass


def spare_inventory(deployment: Deployment, spare: str = SPARE_ADDRESS, name: str = "inventory-spares") -> str:
    """The default inventory plus one host, local-spare-0 at ``spare``, in the group "spares" (pp_auto)."""
    inventory = deployment.root / name
    (inventory / "group_vars").mkdir(parents=True, exist_ok=True)
    common = (REPO / "inventory" / "group_vars" / "all.yml").read_text()
    (inventory / "group_vars" / "all.yml").write_text(common.replace("{{ inventory_dir | dirname }}", str(REPO)))
    hosts = (REPO / "inventory" / "hosts.yml").read_text()
    (inventory / "hosts.yml").write_text(hosts + "    spares:\n      hosts:\n        local-spare-0:\n"
                                         f"          ansible_host: {spare}\n          mlxcel_node_id: spare-0\n")
    return str(inventory)
