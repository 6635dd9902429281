"""bench/protection_bench.py (``pipeline_bench protection``): protected against attribution-only
unprotected greedy decode of an in-process 2-stage pipeline, ABBA, rows with the environment and the
ratio's spread; on a tiny random checkpoint. The benchmark runs in its own process (it takes an
attribution token, after which no role may start in that process)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from mlxcel.cluster import attribution
from mlxcel.cluster.wire import Suite

pytestmark = pytest.mark.proc  # starts a process (tests/proc_marker.py)

REPO = Path(__file__).resolve().parents[2]
RUNS, TOKENS = 2, 4


@pytest.fixture(scope="module")
def rows(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("protection-bench")
    proc = subprocess.run([sys.executable, "-m", "bench.pipeline_bench", "protection", "-m", str(tiny_llama),
                           "--runs", str(RUNS), "--tokens", str(TOKENS), "--warmup", "1", "--label", "test",
                           "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in (out / "pipeline_protection.jsonl").read_text().splitlines()]


def test_abba_runs_of_both_modes_on_identical_tokens(rows: list[dict]) -> None:
    runs = [r for r in rows if r["mode"] != "summary"]
    assert [(r["run"], r["mode"]) for r in runs] == [(0, "protected"), (0, "unprotected"),
                                                     (1, "unprotected"), (1, "protected")]
    assert all(r["identical"] and r["tokens"] == TOKENS and r["tok_s"] > 0 for r in runs)
    assert all(r["frames_per_token"] > 0 and r["bytes_per_token"] > 0 for r in runs)


def test_summary_has_the_ratio_and_its_spread(rows: list[dict]) -> None:
    runs, summary = rows[:-1], rows[-1]
    assert summary["mode"] == "summary" and summary["runs"] == RUNS and summary["identical"] is True
    med = {m: statistics.median(r["tok_s"] for r in runs if r["mode"] == m) for m in ("protected", "unprotected")}
    assert summary["protected_tok_s"] == pytest.approx(med["protected"])
    assert summary["ratio"] == pytest.approx(med["protected"] / med["unprotected"])
    per_round = [next(r["tok_s"] for r in runs if r["run"] == i and r["mode"] == "protected")
                 / next(r["tok_s"] for r in runs if r["run"] == i and r["mode"] == "unprotected") for i in range(RUNS)]
    assert (summary["ratio_min"], summary["ratio_max"]) == pytest.approx((min(per_round), max(per_round)))


def test_every_row_carries_the_environment(rows: list[dict]) -> None:
    for row in rows:
        env = row["env"]
        assert env["git_commit"] and env["host"] and env["date"] and env["versions"]["mlx"]
        assert row["label"] == "test" and row["model"] and row["stages"] == 2 and "load_1m" in row or "load_1m_max" in row


def test_rows_validate_against_the_report_schema(rows: list[dict]) -> None:
    from mlxcel.report.schema import validate_row

    tables = [validate_row(r)[0] for r in rows]
    assert tables == ["pipeline_protection"] * (2 * RUNS) + ["pipeline_protection_summary"]


def test_only_the_unprotected_pipeline_runs_unsealed_frames(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from bench import protection_bench as bench
    from mlxcel.models.loading import load_checkpoint

    monkeypatch.setattr(attribution, "_state", attribution._State())  # this test's token stays in this test
    tokenizer = load_checkpoint(tiny_llama, lazy=True).tokenizer
    for mode, suite in (("protected", Suite.AES_256_GCM), ("unprotected", Suite.UNPROTECTED)):
        pipe = bench.build_pipeline(mode, tiny_llama, tokenizer)
        try:
            out, _ = pipe.generate([1, 2, 3], 2)
            assert len(out) == 2
            members = [pipe.executor.transport, *(s.transport for s in pipe.stages)]
            assert {t.options.suite for t in members} == {suite}
            stage0 = pipe.stages[0].transport
            assert stage0.connection(pipe.stages[1].node.address).sealer.suite is suite  # what actually seals
        finally:
            pipe.close()
    assert len(attribution._state.issued) == 1  # only the unprotected pipeline took a token
