"""``mlxcel report`` at the command line: bad input named by file and line, exit codes, options."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd

from mlxcel.cli import main
from tests.report.conftest import FIXTURES
import pytest

pytestmark = pytest.mark.proc  # starts processes (tests/proc_marker.py)

BAD = FIXTURES / "bad"
EXPECTED = [
    "notes.csv:1: no 'bench' column",
    "pipeline_bench.jsonl:2: not JSON",
    "pipeline_bench.jsonl:3: unknown benchmark 'disagg'",
    "pipeline_bench.jsonl:4: missing field 'tok_s'",
    "pipeline_bench.jsonl:5: field 'tok_s': expected a finite number, got 'fast'",
    "pipeline_bench.jsonl:6: expected a JSON object",
    "pipeline_bench.jsonl:7: no 'env' field",
    "pipeline_bench.jsonl:8: field 'streams': expected an integer, got 2.5",
    "serve_bench-20261130-120000.csv:3: field 'concurrency': expected an integer, got 'two'",
]


def test_malformed_rows_are_named_and_nothing_is_written(tmp_path: Path, capsys):
    out = tmp_path / "r"
    assert main(["report", str(BAD), "-o", str(out)]) == 1
    err = capsys.readouterr().err
    for line in EXPECTED:
        assert line in err, line
    assert "mlxcel: error: 9 invalid rows or files; nothing written" in err
    assert not out.exists()


def test_keep_going_lists_the_rejected_rows_in_the_report(tmp_path: Path, capsys):
    out = tmp_path / "r"
    assert main(["report", str(BAD), "-o", str(out), "--keep-going"]) == 1
    page = (out / "index.html").read_text()
    for line in EXPECTED:
        assert line.split(":", 1)[1].replace("'", "&#39;") in page, line
    assert len(pd.read_csv(out / "rows_pipeline.csv")) == 1  # the one good row
    assert len(pd.read_csv(out / "rows_serve.csv")) == 1
    assert len(pd.read_csv(out / "rejected.csv")) == len(EXPECTED)


def test_missing_input_and_missing_baseline(tmp_path: Path, capsys):
    assert main(["report", str(tmp_path / "nope"), "-o", str(tmp_path / "r")]) == 1
    assert "no such file or directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / "empty"), "-o", str(tmp_path / "r")]) == 1
    assert "no .jsonl or .csv result files under" in capsys.readouterr().err
    assert main(["report", str(FIXTURES / "results"), "-o", str(tmp_path / "r"), "--baseline", str(tmp_path / "x")]) == 1
    assert "baseline: no such directory" in capsys.readouterr().err


def test_fail_on_regression_exit_status(tmp_path: Path, capsys):
    base = ["--baseline", str(FIXTURES / "baseline")]
    assert main(["report", str(FIXTURES / "results"), "-o", str(tmp_path / "all"), *base]) == 0
    captured = capsys.readouterr()
    assert "1 regressions" in captured.err
    assert captured.out.strip() == str(tmp_path / "all" / "index.html")
    pipeline = FIXTURES / "results" / "pipeline_bench.jsonl"  # a file works as an input too
    assert main(["report", str(pipeline), "-o", str(tmp_path / "p"), *base, "--fail-on-regression"]) == 3


def test_clear_error_without_the_report_dependencies(tmp_path: Path):
    code = ("import sys; sys.modules['matplotlib'] = None; from mlxcel.cli import main; "
            f"sys.exit(main(['report', {str(FIXTURES / 'results')!r}, '-o', {str(tmp_path / 'r')!r}]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[2], env={**os.environ})
    assert proc.returncode == 1
    assert "pip install 'mlxcel[report]'" in proc.stderr and "matplotlib" in proc.stderr
    assert "Traceback" not in proc.stderr
