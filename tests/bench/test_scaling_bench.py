"""bench/scaling_bench.py at its smallest size, through real processes on loopback: 2 stages behind a
coordinator, a 2-peer --pp-auto bring-up, a 1x1 router; rows carry the measurements the fits read, and
no server process outlives its point."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from bench import scaling_bench as sb

pytestmark = [pytest.mark.proc, pytest.mark.timeout(120)]


def _serve_children() -> list[int]:
    """This process's children that are still ``mlxcel serve`` processes (zombies excluded)."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
            cmd = Path(f"/proc/{name}/cmdline").read_bytes()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[1]) == os.getpid() and fields[0] != "Z" and b"serve" in cmd:
            out.append(int(name))
    return out


def _run(tmp_path: Path, *argv: str) -> list[dict]:
    before = set(_serve_children())  # a test worker may hold other modules' servers (their fixtures)
    assert sb.main([*argv, "--rounds", "1", "--out", str(tmp_path)]) == 0
    assert set(_serve_children()) <= before
    return [json.loads(line) for line in (tmp_path / "scaling_bench.jsonl").read_text().splitlines()]


def test_pipeline_two_stages_one_and_two_streams(tiny_llama, tmp_path):
    rows = _run(tmp_path, "pipeline", "-m", str(tiny_llama), "--stages", "2", "--streams", "2", "--tokens", "3")
    assert [(r["bench"], r["stages"], r["streams"]) for r in rows] == [("scaling_pipeline", 2, 1), ("scaling_pipeline", 2, 2)]
    for r in rows:
        assert r["errors"] == 0 and r["tokens"] == 3 * r["streams"] and r["ms_per_token"] > 0 and r["tok_s"] > 0
        assert r["processes"] == 3 and r["rss_bytes"] > 0 and r["cpu_s_stages"] is not None
        assert r["env"]["host"] and "load_1m" in r


def test_bringup_two_peers_reports_the_push_bytes(tiny_llama, tmp_path):
    [row] = _run(tmp_path, "bringup", "-m", str(tiny_llama), "--peers", "2", "--timeout", "90")
    assert row["bench"] == "scaling_bringup" and row["peers"] == 2
    assert 0 < row["ready_s"] < row["first_token_s"] and row["push_s"] > 0
    assert (row["sent_frames"], row["received_frames"]) == (8, 6)  # docs/bringup.md §4: 4 out, 3 back per stage
    assert row["wire_bytes"] == row["sent_bytes"] + row["received_bytes"] > 0
    assert row["peer_rss_bytes"] > 0 and row["coordinator_rss_bytes"] > 0


def test_router_one_by_one_measures_cpu_and_added_latency(tiny_llama, tmp_path):
    [row] = _run(tmp_path, "router", "-m", str(tiny_llama), "--topologies", "1x1", "--requests", "2", "--tokens", "2",
                 "--idle-s", "0.5")
    assert row["bench"] == "scaling_router" and (row["prefill_nodes"], row["decode_nodes"], row["nodes"]) == (1, 1, 2)
    assert row["router_cpu_s"] >= 0 and row["router_cpu_s_per_request_raw"] >= row["router_cpu_s_per_request"] - 1e-9
    assert row["added_ms_p95"] is not None and row["added_ms_p95"] <= row["ttft_ms_p50"] * 10
