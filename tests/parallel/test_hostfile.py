"""A hostfile group: each rank started on its own (``--tp-rank``), on loopback addresses, under the cluster secret."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from mlxcel.parallel.launch import free_ports
from tests.parallel.test_server import complete
from tests.parallel.util import wait_gone
from tests.server.test_batching import reference_text
from tests.server.util import ServerProcess, stop_process

pytestmark = [pytest.mark.timeout(180), pytest.mark.proc]
CLI = [sys.executable, "-m", "mlxcel"]


@pytest.fixture
def group_files(tmp_path):
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps({"backend": "ring", "hosts": [{"ssh": f"h{i}", "ips": [f"127.0.0.{i + 1}"]}
                                                              for i in range(3)]}))
    secret = tmp_path / "secret"
    secret.write_text("0123456789abcdef0123456789abcdef\n")
    secret.chmod(0o600)
    return hosts, secret


def test_ranks_started_one_by_one_serve_like_one_node(tiny_6_3, group_files):
    hosts, secret = group_files
    port = free_ports(1)[0]
    common = ["--tp-size", "3", "--tp-hostfile", str(hosts), "--tp-port", str(port), "--cluster-secret-file", str(secret)]
    ranks = [subprocess.Popen([*CLI, "serve", "-m", str(tiny_6_3), *common, "--tp-rank", str(r), "--port", "0"],
                              stderr=subprocess.PIPE, text=True) for r in (1, 2)]
    rank0 = None
    try:
        rank0 = ServerProcess(tiny_6_3, "--parallel", "2", *common)
        rank0.wait_ready(120)
        prompt = [1, 60, 61, 62]
        # one device's greedy text, in this process (tests/server/test_batching.py)
        assert complete(rank0, prompt).choices[0].text == reference_text(tiny_6_3, prompt, 24)
        assert stop_process(rank0.proc) == 0
        wait_gone([p.pid for p in ranks], timeout=20)
        for r, proc in zip((1, 2), ranks):
            assert proc.wait() == 0
            assert f"tensor-parallel rank {r} of 3: following rank 0 at 127.0.0.1:{port + 3}" in proc.stderr.read()
    finally:
        if rank0 is not None:
            rank0.stop()
        for proc in ranks:
            stop_process(proc)


def test_a_follower_needs_the_secret(tiny_6_3, group_files, monkeypatch):
    hosts, _ = group_files
    monkeypatch.delenv("MLXCEL_CLUSTER_SECRET", raising=False)
    monkeypatch.delenv("MLXCEL_CLUSTER_SECRET_FILE", raising=False)
    out = subprocess.run([*CLI, "serve", "-m", str(tiny_6_3), "--tp-size", "3", "--tp-hostfile", str(hosts),
                          "--tp-rank", "1", "--port", "0"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert out.stderr.splitlines()[-1].startswith("mlxcel: error: a cluster secret is required but none was configured")


def test_a_follower_with_another_checkpoint_is_refused(tiny_6_3, group_files, tmp_path):
    from mlxcel.models.random_checkpoint import make_random_checkpoint

    other = make_random_checkpoint(tmp_path / "other", family="llama", layers=2, hidden=48, heads=6, kv_heads=3,
                                   intermediate=96)
    hosts, secret = group_files
    common = ["--tp-size", "3", "--tp-hostfile", str(hosts), "--tp-port", str(free_ports(1)[0]),
              "--cluster-secret-file", str(secret)]
    ranks = [subprocess.Popen([*CLI, "serve", "-m", str(model), *common, "--tp-rank", str(r), "--port", "0"],
                              stderr=subprocess.PIPE, text=True) for r, model in ((1, other), (2, tiny_6_3))]
    rank0 = subprocess.Popen([*CLI, "serve", "-m", str(tiny_6_3), *common, "--port", "0"], stderr=subprocess.PIPE,
                             text=True)
    try:
        assert rank0.wait(90) == 1
        assert "rank 1 holds another checkpoint (model identity" in rank0.stderr.read()
        assert ranks[0].wait(30) == 1
        assert "rank 0 refused this rank: rank 1 holds another checkpoint" in ranks[0].stderr.read()
        # rank 2 keeps waiting for a rank 0 (one may start later, up to the join deadline): stopped below
    finally:
        for proc in (rank0, *ranks):
            stop_process(proc, signal.SIGTERM)
