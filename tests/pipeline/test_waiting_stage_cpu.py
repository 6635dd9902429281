"""A pipeline stage that waits for its peers costs almost no CPU: its BLAS worker threads sleep.

OpenBLAS's workers spin for ~0.1 s after each matrix product before they sleep; a stage waits less
than that between two steps, so before the fix a waiting stage burnt a core for the whole request.
Every stage here sleeps before each of its steps (``MLXCEL_TEST_STAGE_STEP_DELAY_S``), so each stage
waits through most of the request; its CPU time over the request is then its own small compute.
The checkpoint is wide enough (1 x 256 x 2048 products) that OpenBLAS runs one decode row on two
threads, which is what wakes the workers.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import pytest

from mlxcel.blas import blas_in_use
from mlxcel.threads import TIMEOUT_ENVS
from tests.pipeline.cluster import STAGE_HOSTS, LocalCluster, Node

TOKENS = 24
STEP_DELAY_S = 0.03  # per stage and step: each stage waits ~2 delays per token, under OpenBLAS's spin time
BUSY_FRACTION = 0.3  # a spinning stage is near 1.0 of the request's wall time; a sleeping one ~0.1

pytestmark = [pytest.mark.skipif(not blas_in_use().startswith("openblas") or os.cpu_count() == 1,
                                reason="needs the preloaded OpenBLAS (scripts/setup.sh) and 2 cores"), pytest.mark.proc]


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mlxcel.models.random_checkpoint import make_random_checkpoint

    return make_random_checkpoint(tmp_path_factory.mktemp("wide-llama"), family="llama", layers=2, hidden=256,
                                  heads=4, kv_heads=2, intermediate=2048)


class FlaggedCluster(LocalCluster):
    """LocalCluster whose stage i gets its own extra flags and environment."""

    def __init__(self, *args, stage_flags: dict[int, tuple[str, ...]], stage_envs: dict[int, dict[str, str]],
                 **kwargs):
        super().__init__(*args, **kwargs)
        self.stage_flags, self.stage_envs = stage_flags, stage_envs

    def start_stage(self, i: int) -> Node:
        env = {**(self.stage_env or {}), **self.stage_envs.get(i, {})}
        node = Node(self.model, self.toml, f"stage-{i}", STAGE_HOSTS[i], *self.stage_flags.get(i, ()), env=env)
        node.wait_ready()
        self.stages.append(node)
        return node


def test_a_waiting_stage_does_not_spin(tmp_path, wide_llama, monkeypatch):
    # stage-0: the defaults (this process's import of mlxcel set the timeout in os.environ: drop it, so
    # the stage's own default is what runs); stage-1: the budget alone must stop the spin, even under
    # OpenBLAS's own 2**28-cycle timeout
    for name in TIMEOUT_ENVS:
        monkeypatch.delenv(name, raising=False)
    cluster = FlaggedCluster(tmp_path, wide_llama, stage_delay=STEP_DELAY_S,
                             stage_flags={1: ("--threads", "1")}, stage_envs={1: {"OPENBLAS_THREAD_TIMEOUT": "28"}})
    try:
        cluster.start()
        body = {"model": "tiny", "prompt": [1, 40, 41, 42], "max_tokens": TOKENS, "temperature": 0,
                "ignore_eos": True}
        assert httpx.post(f"{cluster.url}/v1/completions", json=body, timeout=60).status_code == 200  # warm
        pids = [stage.proc.pid for stage in cluster.stages]
        before = [cpu_seconds(pid) for pid in pids]
        start = time.monotonic()
        reply = httpx.post(f"{cluster.url}/v1/completions", json=body, timeout=60)
        wall = time.monotonic() - start
        used = [cpu_seconds(pid) - b for pid, b in zip(pids, before)]
    finally:
        cluster.stop()
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == TOKENS
    assert wall >= TOKENS * 2 * STEP_DELAY_S
    assert "1 thread(s) per matrix product" in "".join(cluster.stages[1].lines)
    for i, cpu in enumerate(used):
        assert cpu < BUSY_FRACTION * wall, f"stage-{i} used {cpu:.2f} CPU-s in a {wall:.2f} s request: it spins"
