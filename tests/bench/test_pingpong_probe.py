"""bench/gpu/pingpong_probe.py on a tiny checkpoint: every mode runs, gives the same greedy tokens, and writes its row."""

from __future__ import annotations

import json

import pytest

from bench.gpu import pingpong_probe

pytestmark = [pytest.mark.proc, pytest.mark.timeout(180)]  # the two-process modes spawn their halves


def test_every_mode_gives_the_same_tokens_and_a_row(tiny_qwen3, tmp_path):
    out = tmp_path / "pingpong.jsonl"
    modes = ["whole_async", "whole_sync", "split_1proc", "split_2proc", "split_2proc_runner"]
    assert pingpong_probe.main(["-m", str(tiny_qwen3), "--tokens", "6", "--prompt", "5", "--rounds", "1",
                                "--modes", ",".join(modes), "--label", "test", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["mode"] for r in rows] == modes
    for r in rows:
        assert r["tokens"] == 6 and r["same_tokens"] is True and r["tok_s"] > 0, r
        assert r["env"]["versions"]["mlx"], r  # the environment travels with every row
        split = r["mode"].startswith("split")
        assert (r["half0_compute_ms_p50"] is not None) == split and (r["half1_compute_ms_p50"] is not None) == split


def test_an_unknown_mode_is_refused_by_name(tiny_qwen3, capsys):
    with pytest.raises(SystemExit):
        pingpong_probe.main(["-m", str(tiny_qwen3), "--modes", "whole_sync,sideways"])
    assert "unknown mode(s): sideways" in capsys.readouterr().err


def test_its_rows_pass_the_report_schema(tiny_qwen3, tmp_path):
    from mlxcel.report.schema import validate_row

    out = tmp_path / "pingpong.jsonl"
    pingpong_probe.main(["-m", str(tiny_qwen3), "--tokens", "3", "--prompt", "4", "--rounds", "1",
                         "--modes", "whole_sync,split_1proc", "--out", str(out)])
    for line in out.read_text().splitlines():
        bench, row = validate_row(json.loads(line))
        assert bench == "pingpong_probe" and row["same_tokens"] is True
