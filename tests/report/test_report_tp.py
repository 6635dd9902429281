"""mlxcel report on tensor-parallel rows (bench/tp_bench.py), and the schemas of bring-up and prefix-TTFT rows."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pandas as pd
import pytest

from mlxcel.report.build import build_report
from mlxcel.report.load import load
from mlxcel.report.schema import RowError, validate_row

ENV = {"host": "box", "git_commit": "a" * 40, "cpu_count": 2, "mlx_device": "Device(cpu, 0)"}
SHAPE = {"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 8,
         "num_key_value_heads": 4, "intermediate_size": 512, "vocab_size": 512, "quantized": False}


def tp_row(impl: str, batch: int, variant: str, tok_s: float, rnd: int, order: int, *, compared: str = "tp1,model",
           tokens: str = "t" * 16, minute: int = 0) -> dict:
    return {"bench": "tp_bench", "impl": impl, "model": "/m/tiny", "model_name": "tiny", "shape": SHAPE,
            "backend": "ring", "tp": 1 if variant == "tp1" else 2, "tp_compared": 2, "batch": batch, "round": rnd,
            "order": order, "warmup": 3, "steps": 16, "decode_tok_s": tok_s, "step_ms_p50": 1e3 * batch / tok_s,
            "step_ms_p95": 2e3 * batch / tok_s, "wall_s": 2.0, "cpus": 2, "variant": variant, "compared": compared,
            "tokens_sha256": tokens, "invocation": f"2026-12-01T13:{minute:02d}:00Z",
            "env": {**ENV, "date": f"2026-12-01T13:{minute:02d}:{rnd * 4 + order:02d}+00:00"}}


def abba(impl: str, batch: int, a: str, b: str, values: list[tuple[float, float, float, float]], **kw) -> list[dict]:
    """One A B B A round per entry of ``values`` (A, B, B, A tok/s)."""
    rows = []
    for rnd, vals in enumerate(values):
        for order, (variant, v) in enumerate(zip((a, b, b, a), vals)):
            rows.append(tp_row(impl, batch, variant, v, rnd, order, compared=f"{a},{b}", **kw))
    return rows


def write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_tp_summary_ratios_over_abba_rounds(tmp_path):
    rows = abba("mlxcel", 1, "tp1", "model", [(10, 5, 7, 12), (8, 4, 6, 10)])
    rows += abba("mlx-lm", 8, "model", "bfloat16", [(40, 44, 42, 38)], minute=5, tokens="u" * 16)
    out = tmp_path / "report"
    result = build_report([write(tmp_path / "tp.jsonl", rows)], out)
    assert not result.problems and "tp_summary.csv" in result.csv_files
    summary = pd.read_csv(out / "tp_summary.csv")
    assert len(summary) == 2
    one = summary[summary["impl"] == "mlxcel"].iloc[0]
    assert (one["a"], one["b"], one["a_tok_s_n"], one["rounds"]) == ("tp 1", "tp 2", 4, 2)
    assert one["a_tok_s_median"] == statistics.median([10, 12, 8, 10])
    assert (one["b_tok_s_min"], one["b_tok_s_max"]) == (4, 7)
    per_round = [6 / 11, 5 / 9]  # median B / median A in each round
    assert one["ratio_median"] == pytest.approx(statistics.median(per_round))
    assert (one["ratio_min"], one["ratio_max"]) == (pytest.approx(min(per_round)), pytest.approx(max(per_round)))
    assert bool(one["fair_comparison"]) and one["tokens"] == "same"
    bf16 = summary[summary["impl"] == "mlx-lm"].iloc[0]
    assert (bf16["a"], bf16["b"], bf16["ratio_median"]) == ("tp 2", "tp 2, bfloat16 all-reduce", pytest.approx(43 / 39))
    page = (out / "index.html").read_text()
    assert 'id="tp"' in page and "tp 2, bfloat16 all-reduce" in page and "0.55x" in page
    metrics = pd.read_csv(out / "metrics.csv")
    assert len(metrics[metrics["bench"] == "tp"]) == 4  # each side of each comparison, with its spread


def test_no_ratio_where_a_round_lacks_a_side_and_differing_tokens_show(tmp_path):
    rows = abba("mlxcel", 1, "tp1", "model", [(10, 5, 7, 12)])
    rows += [r for r in abba("mlxcel", 1, "tp1", "model", [(9, 5, 5, 9)]) if r["variant"] == "tp1"]
    for r in rows[4:]:
        r["round"] = 1
    rows[1]["tokens_sha256"] = "v" * 16
    summary = pd.read_csv(build_report([write(tmp_path / "tp.jsonl", rows)], tmp_path / "r").out_dir / "tp_summary.csv")
    row = summary.iloc[0]
    assert not bool(row["fair_comparison"]) and pd.isna(row["ratio_median"]) and row["tokens"] == "differ"


def test_rows_written_before_variants_pair_tp1_with_tp_n(tmp_path):
    rows = abba("mlx-lm", 8, "tp1", "model", [(20, 10, 10, 20)])
    for r in rows:
        for key in ("variant", "compared", "tokens_sha256", "invocation"):
            del r[key]
    summary = pd.read_csv(build_report([write(tmp_path / "tp.jsonl", rows)], tmp_path / "r").out_dir / "tp_summary.csv")
    assert len(summary) == 1
    row = summary.iloc[0]
    assert (row["a"], row["b"], row["ratio_median"], row["tokens"]) == ("tp 1", "tp 2", 0.5, "not recorded")
    assert row["session"] == "tp.jsonl @ 2026-12-01T13:00:00+00:00"  # dated by its first row


@pytest.mark.parametrize("change,message", [
    ({"variant": "float8"}, "field 'variant': 'float8' is not one of"),
    ({"impl": "vllm"}, "field 'impl': 'vllm' is not one of mlxcel, mlx-lm"),
    ({"decode_tok_s": None}, "field 'decode_tok_s' is empty"),
    ({"tp": "two"}, "field 'tp': expected an integer"),
])
def test_bad_tp_rows_are_rejected(change, message):
    with pytest.raises(RowError, match=message):
        validate_row({**tp_row("mlxcel", 1, "model", 5.0, 0, 1), **change})


BRINGUP = {"bench": "bringup", "mode": "static", "ready_s": 10.5, "first_token_s": 11.8,
           "model": "smollm2-135m-instruct", "round": 0}
PREFIX = {"bench": "prefix_ttft", "label": "single", "run": 0, "prefix_tokens": 1000, "prompt_tokens": 1013,
          "cold_ttft_s": 10.1, "warm_ttft_s": 0.41, "warm_reused_tokens": 1000, "warm_hit": True}


def test_bringup_and_prefix_ttft_rows_load_into_their_tables(tmp_path):
    rows = [{**BRINGUP, "env": {**ENV, "date": "2026-12-01T13:00:00+00:00"}},
            {**PREFIX, "env": {**ENV, "date": "2026-12-01T13:00:00+00:00"}}]
    loaded = load([write(tmp_path / "rows.jsonl", rows)])
    assert loaded.problems == []
    assert loaded.table("bringup")["first_token_s"].tolist() == [11.8]
    assert loaded.table("prefix_ttft")["warm_hit"].tolist() == [True]


@pytest.mark.parametrize("row,message", [
    ({**BRINGUP, "mode": "ssh"}, "field 'mode': 'ssh' is not one of static, mdns, toml"),
    ({k: v for k, v in BRINGUP.items() if k != "first_token_s"}, "missing field 'first_token_s'"),
    ({**PREFIX, "warm_hit": "yes"}, "field 'warm_hit': expected true or false"),
    ({**PREFIX, "cold_ttft_s": -1}, "field 'cold_ttft_s': negative value"),
])
def test_bad_bringup_and_prefix_rows_are_rejected(row, message):
    with pytest.raises(RowError, match=message):
        validate_row(row)


def test_disagg_rows_validate_with_or_without_a_handoff():
    base = {"bench": "disagg_handoff", "run": "r", "topology": "hybrid", "repeat": 0, "order": 0,
            "target_prompt_tokens": 64, "prompt_tokens": 70, "completion_tokens": 8, "ttft_ms": 400.0,
            "e2e_ms": 900.0, "model_dir": "models/m"}
    table, row = validate_row(base)
    assert table == "disagg_handoff" and row["handoff_bytes"] is None
    assert validate_row({**base, "topology": "1p1d", "handoffs": 1, "handoff_bytes": 3_000_000})[1]["handoffs"] == 1
    with pytest.raises(RowError, match="missing field 'topology'"):
        validate_row({k: v for k, v in base.items() if k != "topology"})
