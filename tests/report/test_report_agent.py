"""The report's "Agent conversations" section (mlxcel/report/agent.py) from bench/agent_turns.py rows: TTFT per turn
by variant (table, plot, CSV) with the prefix reuse of each turn, and the benchmark's summary and ratio rows with
whether each met its goal."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from bench.agent_conv import summaries
from mlxcel.report.build import build_report
from mlxcel.report.schema import RowError, validate_row

ENV = {"host": "box", "date": "2026-12-07T18:00:00+00:00", "git_commit": "a" * 40, "cpu": "test cpu", "cpu_count": 2,
       "machine": {"id": "m1", "arch": "x86_64"}, "versions": {"mlx": "0.0", "mlxcel": "0.0"}}
COMMON = {"bench": "agent_turns", "label": "cpu", "model": "tiny", "conversations": 2, "turns": 3, "max_tokens": 8,
          "wire": "text", "run": "20261207-180000", "model_dir": "models/tiny"}
LATER = {"single": 20.0, "prefix": 22.0, "round-robin": 90.0}


def turn_row(variant: str, rep: int, c: int, t: int) -> dict:
    ttft = 400.0 if t == 1 else LATER[variant] + 10 * rep + c
    return {**COMMON, "mode": "turn", "variant": variant, "topology": "single" if variant == "single" else "2p1d",
            "args": "", "repeat": rep, "order": 0, "conversation": c, "turn": t, "seed": 0, "system_words": 10,
            "result_words": 10, "prompt_sha256": "c" * 64, "reusable_tokens": 0 if t == 1 else 100 * (t - 1),
            "wave_reusable_tokens": 0 if t == 1 else 200 * (t - 1), "wave_cached_tokens": 0 if t == 1 else 150 * (t - 1),
            "wave_hits": 0 if t == 1 else 2, "ttft_ms": ttft, "e2e_ms": ttft + 70, "prompt_tokens": 100 * t,
            "completion_tokens": 8, "cached_tokens": None, "decode_tps": 100.0, "error": "", "load_1m": 1.5}


def rows() -> list[dict]:
    turns = [turn_row(v, rep, c, t) for rep in (0, 1) for v in LATER for c in (0, 1) for t in (1, 2, 3)]
    return [*turns, *({**COMMON, **s, "run": COMMON["run"]} for s in summaries(turns, "single", [("round-robin", "prefix")]))]


def test_ttft_per_turn_and_the_goals_land_in_the_report(tmp_path: Path) -> None:
    results = tmp_path / "results" / "2026-12-07"
    results.mkdir(parents=True)
    (results / "agent_turns.jsonl").write_text("".join(json.dumps({**r, "env": ENV}) + "\n" for r in rows()))
    result = build_report([tmp_path / "results"], tmp_path / "report")
    assert not result.problems
    assert {"agent_turn_summary.csv", "agent_variant_summary.csv"} <= set(result.csv_files)
    turns = pd.read_csv(tmp_path / "report" / "agent_turn_summary.csv")
    single = turns[turns["variant"] == "single"].set_index("turn")
    assert list(single.index) == [1, 2, 3] and single.loc[1, "ttft_ms_median"] == 400.0
    assert (single.loc[2, "ttft_ms_median"], single.loc[2, "ttft_ms_min"], single.loc[2, "ttft_ms_max"]) == (25.5, 20, 31)
    assert single.loc[3, "cached_tokens"] == 600 and single.loc[3, "reuse"] == pytest.approx(0.75)  # 2 repeats
    assert pd.isna(single.loc[1, "reuse"]) and single.loc[2, "requests"] == 4
    variants = pd.read_csv(tmp_path / "report" / "agent_variant_summary.csv")
    goal = dict(zip(variants["variant"] + "/" + variants["mode"], variants["goal_met"].fillna("–")))
    assert goal == {"single/summary": "–", "prefix/summary": "yes", "round-robin/summary": "no",
                    "round-robin/ratio": "yes"}
    page = (tmp_path / "report" / "index.html").read_text()
    assert "Agent conversations" in page and "2 conversations at once" in page and "75.0%" in page
    assert page.count('alt="Agent conversations: TTFT and prefix reuse per turn') == 1


def test_a_turn_row_without_its_wave_or_with_an_unknown_wire_is_rejected() -> None:
    row = turn_row("single", 0, 0, 2)
    validate_row(row)
    with pytest.raises(RowError, match="wave_reusable_tokens"):
        validate_row({k: v for k, v in row.items() if k != "wave_reusable_tokens"})
    with pytest.raises(RowError, match="wire"):
        validate_row({**row, "wire": "smoke"})
    with pytest.raises(RowError, match="mode"):
        validate_row({**row, "mode": "turns"})
