"""bench/serve_bench.py's side-by-side parts used by the H200 ``serve`` suite: GPU-utilisation rows, the ratio
summary over ABBA rounds, the launch environment of the synchronous-scheduler kind."""

from __future__ import annotations

import pytest

from bench.serve_bench import GpuUtil, gpu_util_fields, launch_command, launch_env, ratios

pytestmark = pytest.mark.proc


def test_gpu_util_fields_parse_nvidia_smi_lines():
    assert gpu_util_fields("90, 3100\n80, 9000\n 100 , 4000\n") == {
        "gpu_util_mean": 90.0, "gpu_util_p50": 90.0, "gpu_util_samples": 3, "gpu_mem_max_mib": 9000.0}
    assert gpu_util_fields("") == {"gpu_util_mean": None, "gpu_util_p50": None, "gpu_util_samples": 0,
                                   "gpu_mem_max_mib": None}


def test_gpu_util_without_nvidia_smi_gives_no_samples(monkeypatch):
    monkeypatch.setattr(GpuUtil, "COMMAND", ["/nonexistent/nvidia-smi"])
    assert GpuUtil.start().stop()["gpu_util_samples"] == 0


def test_ratios_pair_each_round_with_the_baseline():
    rows = [{"server": s, "concurrency": 32, "round": r, "agg_tps": t, "gpu_util_mean": u}
            for s, r, t, u in [("mlxcel", 0, 150.0, 90.0), ("mlx_lm", 0, 100.0, 60.0),
                               ("mlx_lm", 1, 100.0, 62.0), ("mlxcel", 1, 170.0, 88.0)]]
    got = {r["server"]: r for r in ratios(rows)}
    assert (got["mlxcel"]["ratio_mean"], got["mlxcel"]["ratio_min"], got["mlxcel"]["ratio_max"]) == (1.6, 1.5, 1.7)
    assert got["mlxcel"]["gpu_util_mean"] == 89.0 and got["mlx_lm"]["ratio_mean"] == 1.0


def test_the_sync_kind_turns_asynchronous_scheduling_off_and_traces_apart(tmp_path):
    trace = str(tmp_path / "steps.jsonl")
    assert launch_env("mlxcel-sync", trace)["MLXCEL_ASYNC_SCHED"] == "0"
    assert launch_env("mlxcel-sync", trace)["MLXCEL_STEP_TRACE"].endswith("steps-mlxcel-sync.jsonl")
    assert launch_env("mlxcel-async", trace)["MLXCEL_ASYNC_SCHED"] == "1"
    assert launch_env("mlxcel", trace)["MLXCEL_STEP_TRACE"] == trace
    assert "MLXCEL_STEP_TRACE" not in launch_env("mlx_lm", trace)


SWITCHES = ("MLXCEL_ASYNC_SCHED", "MLXCEL_BATCH_TAILS")


@pytest.mark.parametrize("kind, variable, value", [("mlxcel-lone-tails", "MLXCEL_BATCH_TAILS", "0")])
def test_a_switch_kind_sets_its_variable_and_nothing_else(tmp_path, monkeypatch, kind, variable, value):
    """mlxcel-lone-tails: batched prompt tails off, traced apart (mlxcel-stable went with its switch)."""
    for name in SWITCHES:
        monkeypatch.delenv(name, raising=False)
    env = launch_env(kind, str(tmp_path / "steps.jsonl"))
    assert env[variable] == value and not (set(SWITCHES) - {variable}) & set(env)
    assert env["MLXCEL_STEP_TRACE"].endswith(f"steps-{kind}.jsonl")
    assert variable not in launch_env("mlxcel", None)
    assert launch_command(kind, "m", 1, 4)[-8:-6] == ["-m", "m"]
