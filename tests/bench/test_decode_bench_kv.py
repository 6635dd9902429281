"""``bench/decode_bench.py --kv-bits / --prompt-tokens`` on a tiny checkpoint, its rows in the report, and
``kv_quant.kv_bytes_per_token`` (the docs' max-context calculator) against real caches' bytes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.decode_bench import main
from mlxcel.engine.kv_quant import KVBitsError, kv_bytes_per_token, max_kv_tokens
from mlxcel.report.schema import RowError, validate_row
from tests.engine.test_kv_bits import make_llama

pytestmark = pytest.mark.proc  # write_jsonl's environment runs git and uname

SMOLLM2 = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
           "hidden_size": 576, "torch_dtype": "float32"}
QWEN3_06B = {"num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
             "hidden_size": 1024, "torch_dtype": "bfloat16"}
QWEN3_8B = {"num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "hidden_size": 4096, "torch_dtype": "bfloat16"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_llama(tmp_path_factory, "kv-decode-bench")  # 4 layers, 2 KV heads of 32, float32


@pytest.fixture(scope="module")
def rows(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("decode-kv") / "decode_bench.jsonl"
    assert main(["-m", str(tiny), "--prompt-tokens", "40", "90", "--kv-bits", "0", "8", "4", "--kv-group-size", "32",
                 "--tokens", "3", "--runs", "2", "--label", "noisy: test", "--out", str(out)]) == 0
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_every_variant_runs_at_every_context_in_abba_order(rows):
    runs = [r for r in rows if r["impl"] != "summary"]
    assert len(runs) == 2 * 3 * 2 * 2  # contexts x variants x impls x runs
    assert {(r["prompt_tokens"], r["kv_bits"], r["impl"]) for r in runs} == \
        {(n, b, i) for n in (40, 90) for b in (None, 8, 4) for i in ("mlxcel", "mlx-lm")}
    for n in (40, 90):
        seq = [[(r["kv_bits"], r["impl"]) for r in runs if r["prompt_tokens"] == n and r["run"] == k] for k in (0, 1)]
        assert seq[1] == seq[0][::-1] and [r["order"] for r in runs[:6]] == list(range(6))
    assert all(r["kv_group_size"] == (32 if r["kv_bits"] else None) for r in runs)
    assert all(r["label"] == "noisy: test" and r["load_1m"] >= 0 and r["generated_tokens"] == 3 for r in runs)


def test_kv_bytes_come_from_the_caches_and_match_the_calculator(rows, tiny: Path):
    config = json.loads((tiny / "config.json").read_text())
    for r in (r for r in rows if r["impl"] != "summary"):
        per_token = kv_bytes_per_token(config, r["kv_bits"], 32, dtype_bytes=4)
        assert r["kv_cache_positions"] >= r["prompt_tokens"]
        assert r["kv_cache_bytes"] == per_token * r["kv_cache_positions"], r
        assert r["kv_cache_alloc_bytes"] >= r["kv_cache_bytes"]
    by = {(r["kv_bits"], r["impl"]): r["kv_cache_bytes"] / r["kv_cache_positions"] for r in rows
          if r["impl"] != "summary" and r["prompt_tokens"] == 90}
    # 4 layers x K,V x 2 heads: float32 32 x 4 B = 128 B; 8-bit 32 B + scale and bias 8 B; 4-bit 16 + 8 B
    for impl in ("mlxcel", "mlx-lm"):
        assert (by[None, impl], by[8, impl], by[4, impl]) == (4 * 2 * 2 * 128, 4 * 2 * 2 * 40, 4 * 2 * 2 * 24)


def test_summaries_per_context_and_variant_validate(rows):
    summaries = [r for r in rows if r["impl"] == "summary"]
    assert {(r["prompt_tokens"], r["kv_bits"]) for r in summaries} == {(n, b) for n in (40, 90) for b in (None, 8, 4)}
    for r in rows:
        table, typed = validate_row(r)
        assert table == ("decode_recorded_summary" if r in summaries else "decode")
        assert (typed["kv_bits"], typed["kv_group_size"]) == (r["kv_bits"], r["kv_group_size"])
    run = next(r for r in rows if r["kv_bits"] == 8 and r["impl"] == "mlxcel")
    text = {k: "" if v is None else str(v) for k, v in run.items() if k != "env"}  # as a CSV record
    typed = validate_row(text, from_text=True)[1]
    assert (typed["kv_bits"], typed["kv_group_size"], typed["kv_cache_bytes"]) == (8, 32, run["kv_cache_bytes"])
    assert validate_row({**text, "kv_bits": ""}, from_text=True)[1]["kv_bits"] is None  # older rows: full precision
    with pytest.raises(RowError, match="kv_bits"):
        validate_row({**run, "kv_bits": "eight"})
    q4 = next(r for r in summaries if (r["prompt_tokens"], r["kv_bits"]) == (90, 4))
    assert q4["mlxcel_kv_cache_bytes"] < next(r for r in summaries if (r["prompt_tokens"], r["kv_bits"]) ==
                                              (90, None))["mlxcel_kv_cache_bytes"]


def test_report_splits_decode_by_kv_variant_and_context(rows, tmp_path: Path):
    from mlxcel.report.load import load
    from mlxcel.report.tables import decode_comparison, decode_summary

    (tmp_path / "decode_bench.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = load([tmp_path]).table("decode")
    cmp = decode_comparison(table)
    assert sorted(zip(cmp["kv"], cmp["context"])) == sorted((k, n) for n in (40, 90) for k in ("full", "8-bit g32",
                                                                                                 "4-bit g32"))
    assert (cmp["runs"] == 2).all() and cmp["mlxcel_kv_cache_bytes_median"].notna().all()
    assert len(decode_summary(table)) == 12


def test_bad_flags_are_refused_before_loading(tiny: Path, tmp_path: Path, capsys):
    with pytest.raises(SystemExit):
        main(["-m", str(tiny), "--kv-bits", "3", "--out", str(tmp_path / "x.jsonl")])
    assert "invalid choice: 3" in capsys.readouterr().err
    with pytest.raises(KVBitsError, match="--kv-group-size must be one of"):
        main(["-m", str(tiny), "--kv-bits", "8", "--kv-group-size", "48", "--out", str(tmp_path / "x.jsonl")])
    with pytest.raises(SystemExit, match="past the model's context"):
        main(["-m", str(tiny), "--prompt-tokens", "100000", "--out", str(tmp_path / "x.jsonl")])
    assert not (tmp_path / "x.jsonl").exists()


def test_calculator_for_the_default_model_and_qwen3_shapes():
    assert [kv_bytes_per_token(SMOLLM2, b) for b in (None, 8, 4)] == [46_080, 12_960, 7_200]
    assert [kv_bytes_per_token(SMOLLM2, b, dtype_bytes=2) for b in (None, 8, 4)] == [23_040, 12_240, 6_480]
    assert [kv_bytes_per_token(QWEN3_06B, b) for b in (None, 8, 4)] == [114_688, 60_928, 32_256]
    assert kv_bytes_per_token(QWEN3_8B, None) == 147_456
    assert max_kv_tokens(QWEN3_8B, 16 * 2**30, 4) == 16 * 2**30 // (36 * 2 * 8 * (64 + 8))
    with pytest.raises(KVBitsError, match="head width 64 is not a whole number of groups"):
        kv_bytes_per_token({**SMOLLM2, "head_dim": 64}, 8, 128)
    with pytest.raises(KVBitsError, match="--kv-bits must be one of"):
        kv_bytes_per_token(SMOLLM2, 3)
