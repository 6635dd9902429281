"""Loading details: CSV twins of JSONL rows, CSV values typed like JSON ones."""

from __future__ import annotations

import shutil
from pathlib import Path

from mlxcel.report.load import load
from mlxcel.report.schema import validate_row
from tests.report.conftest import FIXTURES


def test_csv_rows_without_a_jsonl_twin_are_kept_and_said(tmp_path: Path):
    shutil.copy(FIXTURES / "results" / "frame_bench.jsonl", tmp_path)
    lines = (FIXTURES / "results" / "frame_bench.csv").read_text().splitlines()
    extra = lines[1].replace("unprotected,unprotected,8192", "unprotected,unprotected,4096")
    (tmp_path / "frame_bench.csv").write_text("\n".join([*lines, extra]) + "\n")
    loaded = load([tmp_path])
    frame = loaded.table("frame")
    assert len(frame) == 21
    kept = frame[frame["payload_bytes"] == 4096].iloc[0]
    assert kept["machine"].startswith("unknown") and kept["source_line"] == 22
    assert any("20 of 21 rows repeat rows" in n and "1 kept without environment" in n for n in loaded.notes)


def test_csv_strings_and_json_values_validate_alike():
    csv_row = {"bench": "frame_bench", "mode": "unprotected", "suite": "unprotected", "payload_bytes": "8192",
               "iterations": "40", "p50_us": "18.5", "p95_us": "20", "p99_us": "21", "mean_us": "19",
               "one_way_gib_s": "0.41", "chunk_len": "262144", "remote": "", "quick": "True"}
    json_row = {**csv_row, "payload_bytes": 8192, "iterations": 40, "p50_us": 18.5, "p95_us": 20, "p99_us": 21,
                "mean_us": 19, "one_way_gib_s": 0.41, "chunk_len": 262144, "remote": None, "quick": True}
    assert validate_row(csv_row, from_text=True) == validate_row(json_row)
