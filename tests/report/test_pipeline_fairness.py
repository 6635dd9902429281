"""Ratios between pipeline modes appear only for rows marked fair_comparison (docs/benchmarks.md: the
benchmark's in-process single mode runs at about half a fresh process's speed, so a ratio against it
is not a fair comparison).
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from mlxcel.report import tables
from mlxcel.report.build import build_report

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "report" / "results"
RATIO_HEADER = "vs baseline (fair runs only)"


def pipeline_rows(fair: dict[str, bool] | None = None) -> list[dict]:
    """The fixture pipeline rows, with fair_comparison set per mode where ``fair`` names it."""
    rows = [json.loads(line) for line in (FIXTURES / "pipeline_bench.jsonl").read_text().splitlines()]
    for row in rows:
        if fair and row["mode"] in fair:
            row["fair_comparison"] = fair[row["mode"]]
    return rows


def write_rows(directory: Path, rows: list[dict]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "pipeline_bench.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return directory


def median(rows: list[dict], mode: str, streams: int) -> float:
    return pd.Series([r["tok_s"] for r in rows if r["mode"] == mode and r["streams"] == streams]).median()


def test_unmarked_rows_get_no_ratio_and_say_why(tmp_path):
    result = build_report([write_rows(tmp_path / "in", pipeline_rows())], tmp_path / "out")
    summary = pd.read_csv(tmp_path / "out" / "pipeline_summary.csv")
    assert summary["vs_baseline"].isna().all()
    page = result.index.read_text()
    assert RATIO_HEADER not in page
    assert "not be a fair comparison" in page and "docs/benchmarks.md" in page


@pytest.mark.parametrize("fair, single_unmarked", [
    ({"remote_pp": True, "inproc_pp": True}, True), ({"single": False}, True), ({"single": True}, False)])
def test_a_ratio_needs_both_sides_marked(tmp_path, fair, single_unmarked):
    summary = tables.pipeline_summary(_table(tmp_path, pipeline_rows(fair)))
    assert summary["vs_baseline"].isna().all()
    assert tables.unfair_single(summary) == single_unmarked  # the note is about an unmarked single mode


def test_marked_rows_get_the_ratio_against_their_baseline(tmp_path):
    rows = pipeline_rows({"single": True, "inproc_pp": True, "remote_pp": True})
    result = build_report([write_rows(tmp_path / "in", rows)], tmp_path / "out")
    summary = pd.read_csv(tmp_path / "out" / "pipeline_summary.csv").set_index(["mode", "streams"])
    for streams in (1, 4):
        assert summary.loc[("remote_pp", streams), "vs_baseline"] == \
            pytest.approx(median(rows, "remote_pp", streams) / median(rows, "single", streams))
        assert pd.isna(summary.loc[("single", streams), "vs_baseline"])  # not against itself
    assert not tables.unfair_single(summary.reset_index())
    page = result.index.read_text()
    assert RATIO_HEADER in page and "not be a fair comparison" not in page
    assert f"{median(rows, 'remote_pp', 1) / median(rows, 'single', 1):.2f}x" in page


def test_server_levels_are_held_against_the_single_node_server(tmp_path):
    rows = [dict(r, mode="server_" + {"single": "single", "remote_pp": "remote_pp"}[r["mode"]], fair_comparison=True)
            for r in pipeline_rows() if r["mode"] in ("single", "remote_pp") and r["streams"] == 4]
    summary = tables.pipeline_summary(_table(tmp_path, rows)).set_index("mode")
    assert summary.loc["server_remote_pp", "baseline"] == "server_single"
    assert summary.loc["server_remote_pp", "vs_baseline"] == \
        pytest.approx(median(rows, "server_remote_pp", 4) / median(rows, "server_single", 4))


def _table(tmp_path: Path, rows: list[dict]) -> pd.DataFrame:
    from mlxcel.report.load import load

    loaded = load([write_rows(tmp_path / "rows", rows)])
    assert not loaded.problems
    return loaded.table("pipeline")
