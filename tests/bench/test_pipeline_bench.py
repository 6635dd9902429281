"""bench/pipeline_bench.py: every run of every mode in its own fresh process (ABBA), rows with the
worker's PID, CPU-seconds per process and per-token latency percentiles, and --trace's per-token
timeline; on a tiny random checkpoint with real stage processes on 127.0.0.3/.4."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import pipeline_bench as pb

pytestmark = pytest.mark.proc  # starts processes (tests/proc_marker.py)

MODES = ["single", "inproc_pp", "remote_pp"]
RUNS, TOKENS = 2, 4
NEW_FIELDS = ("worker_pid", "cpu_s_worker", "cpu_s_worker_total", "cpu_s_stage", "cpu_s_stages", "wall_s",
              "latency_ms_p50", "latency_ms_p95", "per_token_ms_p95", "prompt_tokens", "fair_comparison", "load_1m")


@pytest.fixture(scope="module")
def bench_run(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict], list[int]]:
    """One benchmark invocation: (output dir, rows, the stage PIDs it started)."""
    out = tmp_path_factory.mktemp("pipeline-bench")
    started: list[int] = []
    start = pb.StageCluster.start

    def spy(self: pb.StageCluster) -> None:
        start(self)
        started.extend(self.pids)

    pb.StageCluster.start = spy  # type: ignore[method-assign]
    try:
        assert pb.main(["-m", str(tiny_llama), "--runs", str(RUNS), "--tokens", str(TOKENS), "--warmup", "1",
                        "--streams", "", "--modes", ",".join(MODES), "--trace", "--out", str(out)]) == 0
    finally:
        pb.StageCluster.start = start  # type: ignore[method-assign]
    rows = [json.loads(line) for line in (out / "pipeline_bench.jsonl").read_text().splitlines()]
    return out, rows, started


def test_every_mode_and_run_is_a_fresh_process_in_abba_order(bench_run) -> None:
    _, rows, stage_pids = bench_run
    assert [(r["run"], r["mode"]) for r in rows] == [(0, m) for m in MODES] + [(1, m) for m in MODES[::-1]]
    pids = [r["worker_pid"] for r in rows]
    assert len(set(pids)) == len(rows) and os.getpid() not in pids and not set(pids) & set(stage_pids)
    assert all(r["identical"] and r["tokens"] == TOKENS and r["fair_comparison"] is True for r in rows)
    assert len({r["prompt_tokens"] for r in rows}) == 1


def test_rows_carry_cpu_seconds_per_process_and_latency_percentiles(bench_run) -> None:
    _, rows, stage_pids = bench_run
    assert len(stage_pids) == 2
    for r in rows:
        assert all(f in r for f in NEW_FIELDS), [f for f in NEW_FIELDS if f not in r]
        assert r["cpu_s_worker_total"] > r["cpu_s_worker"] >= 0  # the whole life includes imports and load
        assert 0 < r["latency_ms_p50"] <= r["latency_ms_p95"] and 0 < r["per_token_ms_p50"] <= r["per_token_ms_p95"]
        assert len(r["cpu_s_stage"]) == 2 and all(x >= 0 for x in r["cpu_s_stage"])  # Linux: /proc/PID/stat
        assert r["cpu_s_stages"] == pytest.approx(sum(r["cpu_s_stage"]))
    remote = [r for r in rows if r["mode"] == "remote_pp"]
    for r in remote:
        assert r["frames_per_token"] > 0
        assert [s["node_id"] for s in r["stage_state"]] == ["stage-0", "stage-1"]
        # the measured run's steps only, not the warm-up's: the prompt but its last token in one chunk, the
        # last token alone (it gives the first token), then a step per further token
        assert all(s["steps"] == TOKENS + 1 for s in r["stage_state"])
        # no prefix cache on the persistent stages: a repeated prompt is prefilled again, as in a fresh single
        assert all(s["prefix_bytes"] in (0, None) for s in r["stage_state"])
    assert all(r["stage_state"] is None and r["frames_per_token"] is None for r in rows if r not in remote)


def test_trace_has_one_line_per_token_per_run(bench_run) -> None:
    out, rows, _ = bench_run
    for mode in MODES:
        lines = [json.loads(x) for x in (out / f"trace-{mode}.jsonl").read_text().splitlines()]
        assert [(t["run"], t["token"]) for t in lines] == [(run, i) for run in range(RUNS) for i in range(TOKENS)]
        assert [t["kind"] for t in lines[:TOKENS]] == ["prefill"] + ["decode"] * (TOKENS - 1)
        pids = {r["run"]: r["worker_pid"] for r in rows if r["mode"] == mode}
        for t in lines:
            assert t["mode"] == mode and t["pid"] == pids[t["run"]]
            assert 0 <= t["t_submit"] <= t["t_done"]
            assert t["ms"] == pytest.approx((t["t_done"] - t["t_submit"]) * 1e3, abs=2e-3)
        for run in range(RUNS):  # the row's p50 is the decode tokens' median latency
            ms = sorted(t["ms"] for t in lines if t["run"] == run and t["kind"] == "decode")
            row = next(r for r in rows if r["mode"] == mode and r["run"] == run)
            assert row["latency_ms_p50"] == pytest.approx(ms[len(ms) // 2], abs=2e-3)


def test_report_shows_latency_and_cpu_seconds_and_skips_traces(bench_run, tmp_path: Path) -> None:
    import pandas as pd

    from mlxcel.report.build import build_report

    out, rows, _ = bench_run
    result = build_report([out], tmp_path / "report")  # raises on a trace line taken for a row
    assert not result.problems
    summary = pd.read_csv(tmp_path / "report" / "pipeline_summary.csv").set_index("mode")
    for mode in MODES:
        mine = [r for r in rows if r["mode"] == mode]
        assert summary.loc[mode, "latency_ms_p50_median"] == pytest.approx(pd.Series([r["latency_ms_p50"] for r in mine]).median())
        assert summary.loc[mode, "cpu_s_worker_median"] == pytest.approx(pd.Series([r["cpu_s_worker"] for r in mine]).median())
        assert len(summary.loc[mode, "cpu_s_per_stage"].split(", ")) == 2
    assert pd.notna(summary.loc["remote_pp", "vs_baseline"])  # fresh-process rows are marked fair
    page = result.index.read_text()
    assert all(h in page for h in ("latency p50 (ms)", "latency p95 (ms)", "CPU-s worker", "CPU-s per stage"))


def test_stage_processes_are_gone_afterwards(bench_run) -> None:
    _, _, stage_pids = bench_run
    for pid in stage_pids:
        assert not Path(f"/proc/{pid}").exists() or "(Z)" in Path(f"/proc/{pid}/stat").read_text()


def test_proc_cpu_seconds_follow_a_busy_process() -> None:
    burn = "import sys, time\nwhile time.process_time() < 0.3: pass\nprint(time.process_time(), flush=True)\nsys.stdin.read()"
    busy = subprocess.Popen([sys.executable, "-c", burn], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        own = float(busy.stdout.readline())  # the child's own count, then it waits on stdin
        seen = pb.proc_cpu_s(busy.pid)
    finally:
        busy.stdin.close()
        busy.wait(10)
    assert seen is not None and seen == pytest.approx(own, abs=0.03)  # clock ticks: 10 ms
    assert pb.proc_cpu_s(busy.pid) is None  # reaped: gone
    assert pb.cpu_delta([1.0, None], [2.0, 3.0]) is None and pb.cpu_delta([1.0], [1.5]) == [0.5]


def test_a_remote_worker_needs_the_cluster_and_modes_are_checked(capsys) -> None:
    with pytest.raises(SystemExit):
        pb.parse_args(["--worker", "remote_pp"])
    assert "--worker remote_pp needs --cluster" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        pb.parse_args(["--modes", "single,remote"])
    assert "unknown mode(s) remote" in capsys.readouterr().err


def test_reused_workers_keep_one_process_per_mode_in_abba_order(tiny_llama: Path, tmp_path: Path) -> None:
    """--reuse-workers: every run of a mode in the same process, no two modes in one, ABBA kept, rows marked."""
    out = tmp_path / "reused"
    assert pb.main(["-m", str(tiny_llama), "--runs", "2", "--tokens", "3", "--warmup", "1", "--streams", "",
                    "--modes", "single,remote_pp", "--reuse-workers", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in (out / "pipeline_bench.jsonl").read_text().splitlines()]
    assert [(r["run"], r["mode"]) for r in rows] == [(0, "single"), (0, "remote_pp"), (1, "remote_pp"), (1, "single")]
    pids = {m: {r["worker_pid"] for r in rows if r["mode"] == m} for m in ("single", "remote_pp")}
    assert all(len(p) == 1 for p in pids.values()) and not pids["single"] & pids["remote_pp"]
    assert [r["worker_reused"] for r in rows] == [False, False, True, True]
    assert all(r["identical"] and r["tokens"] == 3 and r["compile_step"] is False for r in rows)
