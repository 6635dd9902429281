"""bench.yml's printed summaries (roles/mlxcel_bench/files/bench_summary.py): complete tables with
their headers, serving rounds labelled, and no pipeline ratio for rows not marked fair."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
import pytest

pytestmark = pytest.mark.proc  # starts processes (tests/proc_marker.py)

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "roles" / "mlxcel_bench" / "files" / "bench_summary.py"
FIXTURES = REPO / "tests" / "fixtures" / "report" / "results"
RATIO = re.compile(r"\d\.\d\dx")


def _module():
    spec = importlib.util.spec_from_file_location("bench_summary", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


summary = _module().summary


def jsonl(name: str) -> list[dict]:
    return [json.loads(line) for line in (FIXTURES / name).read_text().splitlines()]


def results(tmp_path: Path, *names: str, pipeline: list[dict] | None = None) -> Path:
    """A bench.yml-like results directory: per-node subdirectories holding the fixture rows."""
    out = tmp_path / "run"
    for name in names:
        (out / "coordinator").mkdir(parents=True, exist_ok=True)
        shutil.copy(FIXTURES / name, out / "coordinator" / name)
    if pipeline is not None:
        (out / "coordinator").mkdir(parents=True, exist_ok=True)
        (out / "coordinator" / "pipeline_bench.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pipeline))
    return out


def section(text: str, title: str) -> list[str]:
    """The lines of one benchmark's part of the summary."""
    part = next(p for p in text.split("\n\n") if p.startswith(title))
    return part.splitlines()


def test_frame_table_is_complete_with_its_header(tmp_path):
    rows = jsonl("frame_bench.jsonl")
    lines = section(summary(results(tmp_path, "frame_bench.jsonl")), "frame")
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["link", "suite"])
    assert set(lines[header + 1].replace(" ", "")) == {"-"}
    body = lines[header + 2:]
    assert len(body) == len(rows)  # every suite and payload, nothing cut off
    for row in rows:
        assert any(row["mode"] in line and f"{row['iterations']:,}" in line for line in body), row["mode"]


def test_serving_rows_are_labelled_with_their_round(tmp_path):
    rows = jsonl("serve_bench.jsonl")
    lines = section(summary(results(tmp_path, "serve_bench.jsonl")), "serving")
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["round", "server"])
    body = lines[header + 2:]
    assert len(body) == len(rows)
    rounds = max(r["round"] for r in rows) + 1
    assert rounds == 2
    for r in range(rounds):
        labelled = [line for line in body if line.strip().startswith(f"round {r + 1}/{rounds}")]
        assert len(labelled) == sum(row["round"] == r for row in rows)


def test_no_pipeline_ratio_for_rows_not_marked_fair(tmp_path):
    text = summary(results(tmp_path, "pipeline_bench.jsonl"))
    table = section(text, "pipeline")
    assert not any(RATIO.search(line) for line in table)
    assert "vs baseline" not in text
    assert "not be a fair comparison" in text  # and it says why


def test_pipeline_ratio_where_every_row_is_marked_fair(tmp_path):
    rows = [dict(r, fair_comparison=True) for r in jsonl("pipeline_bench.jsonl")]
    lines = section(summary(results(tmp_path, pipeline=rows)), "pipeline")
    assert "vs baseline" in " ".join(lines)
    remote = [line for line in lines if line.strip().startswith("remote_pp")]
    assert remote and all(RATIO.search(line) and line.rstrip().endswith("single") for line in remote)
    assert not any("not be a fair comparison" in line for line in lines)


def test_every_benchmark_in_one_run(tmp_path):
    text = summary(results(tmp_path, "frame_bench.jsonl", "pipeline_bench.jsonl", "serve_bench.jsonl"))
    assert [p.splitlines()[0].split()[0] for p in text.split("\n\n")[:3]] == ["frame", "pipeline", "serving"]


def test_command_line(tmp_path):
    ok = subprocess.run([sys.executable, str(SCRIPT), str(results(tmp_path, "serve_bench.jsonl"))],
                        capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert ok.returncode == 0 and "round 2/2" in ok.stdout, ok.stderr
    (tmp_path / "empty").mkdir()
    empty = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "empty")],
                           capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert empty.returncode == 1 and "no .jsonl or .csv result files" in empty.stderr

