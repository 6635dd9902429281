"""The frame benchmark across two network namespaces: --serve-echo on one "host", --remote on the other."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.proc  # starts processes (tests/proc_marker.py)

REPO = Path(__file__).resolve().parents[2]


def _can_make_namespaces() -> bool:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return False
    name = f"mlxcel-probe-{os.getpid()}"  # private to this process: test workers collect in parallel
    probe = subprocess.run(["ip", "netns", "add", name], capture_output=True)
    if probe.returncode != 0:
        return False
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return True


@pytest.mark.timeout(180)
@pytest.mark.skipif(not _can_make_namespaces(), reason="needs root and ip netns")
def test_two_namespace_run_writes_rows_and_cleans_up(tmp_path):
    out = tmp_path / "netns.jsonl"
    result = subprocess.run(
        ["bash", str(REPO / "bench" / "netns_frame_bench.sh"), "--quick", "--suites", "unprotected,aes",
         "--sizes", "8192", "--rounds", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=170, env={**os.environ, "PYTHON": sys.executable},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert {r["suite"] for r in rows} == {"unprotected", "aes_256_gcm"}
    assert all(r["p50_us"] > 0 for r in rows)
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "mlxcel-fb-" not in namespaces
    links = subprocess.run(["ip", "link"], capture_output=True, text=True).stdout
    assert "mxfa" not in links and "mxfb" not in links
