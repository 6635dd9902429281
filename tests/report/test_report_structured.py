"""The report's "Structured output" table (mlxcel/report/structured.py) from bench/structured_bench.py rows: per
level, the json_schema / plain ratios of tok/s and of the per-token gap with their spread, and the load."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from mlxcel.report.build import build_report
from mlxcel.report.schema import RowError, validate_row

ENV = {"host": "box", "date": "2026-12-07T18:00:00+00:00", "git_commit": "a" * 40, "cpu": "test cpu", "cpu_count": 2,
       "machine": {"id": "m1", "arch": "x86_64"}, "versions": {"mlx": "0.0", "mlxcel": "0.0"}}
COMMON = {"bench": "structured_output", "label": "cpu", "model": "tiny", "max_tokens": 48}


def level_row(mode: str, n: int, rnd: int, tps: float) -> dict:
    return {**COMMON, "mode": mode, "concurrency": n, "round": rnd, "order": rnd % 2, "requests": 2 * n, "errors": 0,
            "error_sample": "", "output_tokens": 96 * n, "tokens_min": 48, "tokens_max": 48, "wall_s": 96 * n / tps,
            "agg_tps": tps, "itl_p50_ms": 1e3 / tps, "itl_mean_ms": 1e3 / tps, "ttft_p50_ms": 50.0,
            "prompts_sha256": "b" * 64, "load_1m": 2.5, "load_5m": 3.0, "env": ENV}


def summary(n: int, ratio: float, lo: float, hi: float) -> dict:
    return {**COMMON, "mode": "summary", "concurrency": n, "rounds": 2, "same_tokens": True, "plain_tps": 100.0,
            "schema_tps": 100.0 * ratio, "plain_itl_ms": 10.0, "schema_itl_ms": 10.0 / ratio, "tps_ratio": ratio,
            "tps_ratio_min": lo, "tps_ratio_max": hi, "itl_ratio": 1 / ratio, "itl_ratio_min": 1 / hi,
            "itl_ratio_max": 1 / lo, "cost_pct": round(100 * (1 / ratio - 1), 2), "load_1m_max": 4.25, "env": ENV}


def test_the_ratio_and_its_spread_land_in_the_report(tmp_path: Path) -> None:
    results = tmp_path / "results" / "2026-12-07"
    results.mkdir(parents=True)
    rows = [level_row(m, n, r, t) for n in (1, 32) for r, (m, t) in enumerate([("plain", 100.0), ("json_schema", 97.0)])]
    rows += [summary(32, 0.904, 0.871, 0.937), summary(1, 0.97, 0.955, 0.985)]
    (results / "structured_output.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = build_report([tmp_path / "results"], tmp_path / "report")
    assert not result.problems and "structured_output_summary.csv" in result.csv_files
    table = pd.read_csv(tmp_path / "report" / "structured_output_summary.csv")
    assert list(table["concurrency"]) == [1, 32]  # by level
    row = table.iloc[1]
    assert (row["tps_ratio"], row["tps_ratio_min"], row["tps_ratio_max"]) == pytest.approx((0.904, 0.871, 0.937))
    assert row["load_1m_max"] == 4.25 and row["label"] == "cpu"
    page = (tmp_path / "report" / "index.html").read_text()
    assert "Structured output" in page and "0.904" in page and "0.871" in page and "10.62" in page  # cost %


def test_a_summary_row_without_its_spread_or_with_an_unknown_mode_is_rejected() -> None:
    with pytest.raises(RowError, match="tps_ratio_min"):
        validate_row({k: v for k, v in summary(1, 0.97, 0.95, 0.99).items() if k != "tps_ratio_min"})
    with pytest.raises(RowError, match="mode"):
        validate_row({**summary(1, 0.97, 0.95, 0.99), "mode": "regex"})
    with pytest.raises(RowError, match="load_1m"):
        validate_row({k: v for k, v in level_row("plain", 1, 0, 100.0).items() if k != "load_1m"})
