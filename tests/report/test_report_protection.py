"""The report's "Frame protection, end to end" table (mlxcel/report/protection.py) from
bench/protection_bench.py rows: the summary row's ratio and spread, with session and machine."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from mlxcel.report.build import build_report
from mlxcel.report.schema import RowError, validate_row

ENV = {"host": "box", "date": "2026-12-07T17:00:00+00:00", "git_commit": "a" * 40, "cpu": "test cpu", "cpu_count": 2,
       "machine": {"id": "m1", "arch": "x86_64"}, "versions": {"mlx": "0.0", "mlxcel": "0.0"}}
COMMON = {"bench": "pipeline_protection", "model": "tiny", "stages": 2, "tokens_requested": 8, "label": "cpu"}


def run_row(mode: str, run: int, tok_s: float) -> dict:
    return {**COMMON, "mode": mode, "run": run, "order": 0, "tokens": 8, "tok_s": tok_s, "per_token_ms_p50": 1e3 / tok_s,
            "per_token_ms_p95": 1e3 / tok_s, "frames_per_token": 3.2, "bytes_per_token": 4675.0, "identical": True,
            "load_1m": 1.5, "env": ENV}


SUMMARY = {**COMMON, "mode": "summary", "runs": 2, "identical": True, "protected_tok_s": 95.0,
           "protected_tok_s_min": 90.0, "protected_tok_s_max": 100.0, "unprotected_tok_s": 100.0,
           "unprotected_tok_s_min": 98.0, "unprotected_tok_s_max": 102.0, "ratio": 0.95, "ratio_median": 0.951,
           "ratio_min": 0.918, "ratio_max": 0.984, "cost_ms_per_token": 0.526, "load_1m_max": 1.5, "env": ENV}


def test_summary_row_lands_in_the_report(tmp_path: Path) -> None:
    results = tmp_path / "results" / "2026-12-07"
    results.mkdir(parents=True)
    rows = [run_row("protected", 0, 90.0), run_row("unprotected", 0, 98.0), run_row("unprotected", 1, 102.0),
            run_row("protected", 1, 100.0), SUMMARY]
    (results / "pipeline_protection.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = build_report([tmp_path / "results"], tmp_path / "report")
    assert not result.problems and "protection_summary.csv" in result.csv_files
    table = pd.read_csv(tmp_path / "report" / "protection_summary.csv")
    assert len(table) == 1
    row = table.iloc[0]
    assert (row["ratio"], row["ratio_min"], row["ratio_max"]) == pytest.approx((0.95, 0.918, 0.984))
    assert row["label"] == "cpu" and row["protected_tok_s"] == 95.0
    page = (tmp_path / "report" / "index.html").read_text()
    assert "Frame protection, end to end" in page and "0.950" in page and "0.918" in page


def test_a_summary_row_without_its_ratio_is_rejected() -> None:
    bad = {k: v for k, v in SUMMARY.items() if k != "ratio_max"}
    with pytest.raises(RowError, match="ratio_max"):
        validate_row(bad)
    with pytest.raises(RowError, match="mode"):
        validate_row({**SUMMARY, "mode": "half-protected"})
