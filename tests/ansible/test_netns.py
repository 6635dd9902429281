"""The deployment over real SSH: three hosts in network namespaces (scripts/netns_cluster.sh), each with
its own sshd and address on a bridge. The OpenAI port is off loopback, so the deployment uses an API
key, and here TLS too. Fault drills: a stage's link cut and restored; a host with another checkpoint.

Needs root and ``ip netns``; the script installs openssh-server with apt-get when sshd is missing.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import ssl
import stat
import subprocess
import threading
import time
from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest
import yaml

from mlxcel.models.random_checkpoint import make_random_checkpoint
from tests.ansible.playbook import ANSIBLE_PLAYBOOK, REPO, Deployment
from tests.ansible.tls import self_signed

SCRIPT = REPO / "scripts" / "netns_cluster.sh"
NETNS_ID = str(100 + os.getpid() % 100)  # 10.232.<id>.0/24, namespaces mlxcel-<id>-*: private to this run
ADDRESS = {"coordinator": f"10.232.{NETNS_ID}.2", "stage-0": f"10.232.{NETNS_ID}.3", "stage-1": f"10.232.{NETNS_ID}.4"}
EXCHANGE_S = 4       # [timeouts] exchange_s: the deadline of one decode step


def _can_run() -> bool:
    if os.geteuid() != 0 or shutil.which("ip") is None or not ANSIBLE_PLAYBOOK.exists():
        return False
    if not (os.path.exists("/usr/sbin/sshd") or shutil.which("apt-get")):
        return False
    probe = subprocess.run(["ip", "netns", "add", f"mlxcel-probe-{NETNS_ID}"], capture_output=True)
    subprocess.run(["ip", "netns", "del", f"mlxcel-probe-{NETNS_ID}"], capture_output=True)
    return probe.returncode == 0


pytestmark = [pytest.mark.timeout(600), pytest.mark.skipif(not _can_run(), reason="needs root, ip netns and sshd"),
              pytest.mark.proc]


def _netns(*args: str, state: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "MLXCEL_NETNS_ID": NETNS_ID, "MLXCEL_NETNS_DIR": str(state)}
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> Iterator[Deployment]:
    root = tmp_path_factory.mktemp("netns")
    state = root / "netns"
    up = _netns("up", state=state)
    if up.returncode != 0:
        _netns("down", state=state)
        pytest.fail(f"netns_cluster.sh up failed:\n{up.stdout}\n{up.stderr}")
    cert, key = self_signed(root, ADDRESS["coordinator"])
    d = Deployment(root=root, model=tiny_llama, http_port=8080, cluster_port=19000, extra={
        "mlxcel_tls_enabled": True, "mlxcel_node_tls_cert_src": str(cert), "mlxcel_node_tls_key_src": str(key),
        "mlxcel_smoke_ca_path": str(cert), "mlxcel_config_exchange_s": EXCHANGE_S, "mlxcel_config_heartbeat_s": 1})
    d.extra["inventory"] = str(state / "inventory.yml")
    try:
        yield d
    finally:
        _netns("down", state=state)  # ends every process in the namespaces
        d.kill_leftovers()


def _run(d: Deployment, playbook: str, *args: str, **more: object):
    extra = {k: v for k, v in d.extra.items() if k != "inventory"}
    return Deployment(d.root, d.model, d.http_port, d.cluster_port, extra).run(
        playbook, *args, inventory=d.extra["inventory"], **more)


def _client(d: Deployment, key: str, trust: bool = True) -> openai.OpenAI:
    http = httpx.Client(verify=ssl.create_default_context(cafile=str(d.root / "tls.crt"))) if trust else None
    return openai.OpenAI(base_url=f"https://{ADDRESS['coordinator']}:8080/v1", api_key=key, max_retries=0,
                         timeout=30, http_client=http)


def _chat(client: openai.OpenAI) -> str:
    reply = client.chat.completions.create(model=client.models.list().data[0].id, messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=4, temperature=0)
    return reply.choices[0].finish_reason


def test_deploy_over_ssh_with_api_key_and_tls(cluster: Deployment) -> None:
    result = _run(cluster, "deploy.yml")
    assert result.rc == 0, result.output[-4000:]
    assert set(result.recap()) == {"ns-coordinator", "ns-stage-0", "ns-stage-1"}
    key = (cluster.controller / "api.key").read_text().strip()
    assert f"OpenAI API: https://{ADDRESS['coordinator']}:8080/v1" in result.output and key not in result.output
    assert _chat(_client(cluster, key)) in ("stop", "length")
    with pytest.raises(openai.AuthenticationError):
        _client(cluster, "wrong").models.list()
    with pytest.raises(openai.APIConnectionError):  # a client that does not trust the certificate
        _client(cluster, key, trust=False).models.list()


def test_a_remote_host_runs_the_fast_blas(cluster: Deployment) -> None:
    """``mlxcel generate`` over SSH on a stage host, in the venv the install role set up there, names the
    OpenBLAS from PyPI on its first line (not MLX's reference BLAS)."""
    state = Path(cluster.extra["inventory"]).parent
    venv = yaml.safe_load(Path(cluster.extra["inventory"]).read_text())["mlxcel_cluster"]["vars"]["mlxcel_venv"]
    command = shlex.join([f"{venv}/bin/mlxcel", "generate", "-m", str(cluster.model), "-p", "Hi", "-n", "1", "--raw"])
    ssh = ["ssh", "-i", str(state / "id_ed25519"), "-o", f"UserKnownHostsFile={state / 'known_hosts'}",
           "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes", f"root@{ADDRESS['stage-0']}", command]
    out = subprocess.run(ssh, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    banner = re.search(r"\| blas: (.*)", out.stdout + out.stderr)
    assert banner and re.match(r"openblas \S+ \S+ \(scipy-openblas32: ", banner[1]), (out.stdout + out.stderr)[-3000:]


def test_secrets_are_0600_on_every_host_and_never_leak(cluster: Deployment) -> None:
    secret = (cluster.controller / "cluster.secret").read_text().strip()
    key = (cluster.controller / "api.key").read_text().strip()
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert secret not in ps and key not in ps
    for node in ADDRESS:
        home = cluster.home(node)
        assert stat.S_IMODE((home / "cluster.secret").stat().st_mode) == 0o600
        for name in ("cluster.toml", "node.log", "node.toml"):
            text = (home / name).read_text()
            assert secret not in text and key not in text, f"{node}: a secret is in {name}"
    assert stat.S_IMODE((cluster.home("coordinator") / "api.key").stat().st_mode) == 0o600
    assert stat.S_IMODE((cluster.home("coordinator") / "tls.key").stat().st_mode) == 0o600


def test_cut_stage_link_holds_new_requests_until_it_is_restored(cluster: Deployment) -> None:
    """A cut link to stage-1: the coordinator marks the stage down (status.yml: 503 degraded) and holds a
    new request instead of refusing it (docs/pipeline.md §5.6); once the link is back it is answered."""
    client = _client(cluster, (cluster.controller / "api.key").read_text().strip())
    assert _netns("cut", "stage-1", state=Path(cluster.extra["inventory"]).parent).returncode == 0
    held: dict = {}
    try:
        status = _run(cluster, "status.yml", ansible_timeout=3)  # stage-1 is unreachable over SSH too: exit 4
        assert status.rc in (0, 4), status.output[-3000:]
        assert "503 degraded" in status.output and "ns-stage-1: unreachable" in status.output, status.output[-3000:]
        def ask() -> None:
            try:
                held["reason"] = _chat(client.with_options(timeout=60))
            except openai.APIError as exc:  # a 503 past the hold's bound, or the client's own timeout
                held["error"] = repr(exc)

        t = threading.Thread(target=ask, daemon=True)
        sent = time.monotonic()
        t.start()
        time.sleep(3.0)
        assert t.is_alive() and not held, held  # held, not refused with 503
    finally:
        assert _netns("restore", "stage-1", state=Path(cluster.extra["inventory"]).parent).returncode == 0
    restored = time.monotonic()
    t.join(60)  # the coordinator holds it at most --resume-timeout (30 s) from when it was sent
    print(f"held request answered {time.monotonic() - restored:.1f} s after the link came back "
          f"({time.monotonic() - sent:.1f} s after it was sent): {held}")
    assert held.get("reason") in ("stop", "length"), held


def test_host_with_another_checkpoint_fails_the_deploy_by_name(cluster: Deployment, tmp_path: Path) -> None:
    other = make_random_checkpoint(tmp_path / "other", family="llama", layers=2)
    host_vars = Path(cluster.extra["inventory"]).parent / "host_vars"
    host_vars.mkdir(exist_ok=True)
    (host_vars / "ns-stage-0.yml").write_text(f"mlxcel_model_dir: {other}\n")
    try:
        result = _run(cluster, "deploy.yml", "--tags", "checkpoint")
    finally:
        (host_vars / "ns-stage-0.yml").unlink()
    assert result.rc != 0
    assert {h for h, r in result.recap().items() if r["failed"]} == {"ns-stage-0"}, result.output[-3000:]
    assert f"ns-stage-0: {other} holds a different checkpoint" in result.output.replace("\n", " ")


def test_teardown_leaves_no_process_in_the_namespaces(cluster: Deployment) -> None:
    assert cluster.pids()
    result = _run(cluster, "teardown.yml")
    assert result.rc == 0, result.output[-3000:]
    assert cluster.pids() == []
