"""bench/results stays light (issue 41): traces packed or kept out of git, large row files gzipped and still
read by the report, and the tree in git under its cap."""

from __future__ import annotations

import gzip
import json
import subprocess
import tarfile
from pathlib import Path

from bench.pack_results import ARCHIVE, CAP, main, pack, problems
from mlxcel.report.load import discover, load

ROOT = Path(__file__).resolve().parents[2]


def _row() -> str:
    """A real decode_bench row (with its environment), as committed."""
    with gzip.open(ROOT / "bench/results/2026-11-29/decode_bench.jsonl.gz", "rt") as fh:
        return fh.readline().strip()


def test_pack_archives_traces_gzips_large_rows_and_the_report_reads_them(tmp_path):
    run = tmp_path / "2026-12-07" / "run"
    run.mkdir(parents=True)
    (run / "trace-single.jsonl").write_text('{"t": 1}\n' * 100)
    (run / "trace-steps.jsonl.gz").write_bytes(gzip.compress(b'{"s": 2}\n'))
    rows = "\n".join([_row()] * 40) + "\n"
    (run / "decode_bench.jsonl").write_text(rows)
    (run / "small.csv").write_text("a,b\n1,2\n")
    assert problems(tmp_path)  # an unpacked trace is a problem

    done = pack(tmp_path, gzip_over=1024)

    assert len(done) == 2 and not problems(tmp_path)
    assert sorted(p.name for p in run.iterdir()) == ["decode_bench.jsonl.gz", "small.csv", ARCHIVE]
    with tarfile.open(run / ARCHIVE) as tar:
        assert tar.extractfile("trace-steps.jsonl").read() == b'{"s": 2}\n'  # stored once, uncompressed inside
        assert tar.extractfile("trace-single.jsonl").read().count(b"\n") == 100
    assert gzip.decompress((run / "decode_bench.jsonl.gz").read_bytes()).decode() == rows
    assert discover([tmp_path]) == [run / "decode_bench.jsonl.gz", run / "small.csv"]
    loaded = load([run / "decode_bench.jsonl.gz"])
    assert not loaded.problems and sum(len(table) for table in loaded.tables.values()) == 40

    (run / "trace-single.jsonl").write_text("newer\n")  # a second pack keeps the archive's other members
    pack(tmp_path)
    with tarfile.open(run / ARCHIVE) as tar:
        assert tar.getnames() == ["trace-single.jsonl", "trace-steps.jsonl"]
        assert tar.extractfile("trace-single.jsonl").read() == b"newer\n"


def test_check_fails_over_the_cap(tmp_path, capsys):
    (tmp_path / "big.csv").write_bytes(b"x" * 3000)
    assert main([str(tmp_path), "--check", "--cap", "2000"]) == 1
    assert "over the cap" in capsys.readouterr().err
    assert main([str(tmp_path), "--check"]) == 0


def test_bench_results_in_git_are_under_the_cap_with_no_trace():
    listed = subprocess.run(["git", "ls-files", "-z", "bench/results"], cwd=ROOT, capture_output=True, check=True)
    files = [ROOT / name for name in listed.stdout.decode().split("\0") if name]
    assert files, "git ls-files found nothing under bench/results"
    traces = [f.name for f in files if f.name.startswith(("trace-", "step_trace")) or f.name == ARCHIVE]
    assert not traces
    total = sum(f.stat().st_size for f in files if f.exists())
    assert total <= CAP, f"bench/results holds {total / 1024:.0f} KiB in git (cap {CAP / 1024:.0f} KiB)"
