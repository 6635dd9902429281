"""scripts/benchmark_pipeline_remote_rollout.sh: a thin driver of bench/pipeline_bench.py. Its --help, its
argument errors, and its --dry-run commands, which must parse as pipeline_bench's own arguments."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest

from bench import pipeline_bench, protection_bench

pytestmark = pytest.mark.proc  # runs bash

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "benchmark_pipeline_remote_rollout.sh"


def run(*args: str, env: dict[str, str] | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=30, cwd=cwd,
                          env={"PATH": "/usr/bin:/bin", **(env or {})})


def test_help_documents_arguments_and_outputs() -> None:
    proc = run("--help")
    assert proc.returncode == 0
    for words in ("MODEL_DIR OUT_DIR", "--dry-run", "pipeline_bench.jsonl", "pipeline_protection.jsonl", "RUNS", "TOKENS"):
        assert words in proc.stdout


@pytest.mark.parametrize("args, message", [((), "MODEL_DIR and OUT_DIR are required"),
                                           (("/no/such/model", "out"), "is not a model directory")])
def test_bad_arguments_say_what_is_wrong(args: tuple[str, ...], message: str) -> None:
    proc = run(*args)
    assert proc.returncode == 2 and message in proc.stderr and proc.stdout == ""


def test_dry_run_commands_are_valid_pipeline_bench_invocations(tiny_llama: Path, tmp_path: Path) -> None:
    proc = run("--dry-run", str(tiny_llama), "rows", "--label", "box", env={"RUNS": "3", "TOKENS": "16"}, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    rollout, protection = [shlex.split(line) for line in proc.stdout.splitlines()]
    assert rollout[1:3] == ["-m", "bench.pipeline_bench"] and protection[1:4] == ["-m", "bench.pipeline_bench", "protection"]
    args = pipeline_bench.parse_args(rollout[3:])
    assert (args.model, args.runs, args.tokens, args.label) == (str(tiny_llama), 3, 16, "box")
    assert args.modes == ["single", "remote_pp"] and args.streams == [2, 4, 8] and args.out == tmp_path / "rows"
    p = protection_bench.parse_args(protection[4:])
    assert (p.model, p.runs, p.tokens, p.out) == (str(tiny_llama), 3, 16, tmp_path / "rows")
    assert not (tmp_path / "rows").exists()  # a dry run writes nothing


def test_protection_zero_skips_part_three(tiny_llama: Path) -> None:
    proc = run("--dry-run", str(tiny_llama), "out", env={"PROTECTION": "0"})
    assert proc.returncode == 0 and len(proc.stdout.splitlines()) == 1
