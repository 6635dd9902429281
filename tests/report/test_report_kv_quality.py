"""The report's "Quantized KV cache" table (mlxcel/report/kv_quality.py) from the rows bench/kv_bits_quality.py
committed under bench/results: one summary row per bits, with its agreement, logit errors and bytes per token."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from mlxcel.report.build import build_report
from mlxcel.report.schema import RowError, validate_row

ROWS = Path(__file__).resolve().parents[2] / "bench" / "results" / "2026-12-07" / "kv-bits" / "kv_bits_quality.jsonl"


def test_the_committed_rows_make_the_table_with_8_bits_first(tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    shutil.copy(ROWS, results / ROWS.name)
    result = build_report([results], tmp_path / "report")
    assert not result.problems and "kv_bits_quality_summary.csv" in result.csv_files
    table = pd.read_csv(tmp_path / "report" / "kv_bits_quality_summary.csv")
    summaries = [json.loads(line) for line in ROWS.read_text().splitlines() if '"summary"' in line]
    assert list(table["bits"]) == sorted((r["bits"] for r in summaries), reverse=True)
    eight = table[table["bits"] == 8].iloc[0]
    assert eight["identical_texts"] == 5 and eight["agree"] == pytest.approx(1.0)
    assert eight["kv_bytes_per_token"] < eight["kv_bytes_per_token_full"]
    page = (tmp_path / "report" / "index.html").read_text()
    assert "Quantized KV cache" in page and "12960" in page.replace(",", "")


def test_a_row_without_its_errors_or_of_an_unknown_kind_is_rejected() -> None:
    row = json.loads(ROWS.read_text().splitlines()[0])
    with pytest.raises(RowError, match="max_logit_err"):
        validate_row({k: v for k, v in row.items() if k != "max_logit_err"})
    with pytest.raises(RowError, match="kind"):
        validate_row({**row, "kind": "histogram"})
