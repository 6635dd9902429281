"""bench/tp_bench.py end to end on a tiny checkpoint: both paths, tp 1 and 2 in A B B A order, rows with the environment."""

from __future__ import annotations

import json

import pytest

from bench import tp_bench

pytestmark = [pytest.mark.timeout(300), pytest.mark.proc]


def test_rows_for_both_paths_in_abba_order(tiny_llama, tmp_path, capsys):
    out = tmp_path / "rows.jsonl"
    assert tp_bench.main(["-m", str(tiny_llama), "--tp", "2", "--batch", "2", "--warmup", "1", "--steps", "2",
                          "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["variant"] for r in rows] == ["tp1", "model", "model", "tp1"] * 2
    assert [(r["impl"], r["tp"]) for r in rows] == [("mlxcel", 1), ("mlxcel", 2), ("mlxcel", 2), ("mlxcel", 1),
                                                   ("mlx-lm", 1), ("mlx-lm", 2), ("mlx-lm", 2), ("mlx-lm", 1)]
    for r in rows:
        assert r["decode_tok_s"] > 0 and r["batch"] == 2 and r["steps"] == 2 and r["backend"] == "ring"
        assert len(r["tokens_sha256"]) == 16
        assert r["shape"]["num_attention_heads"] == 4 and r["env"]["python"]
    summary = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in summary] == [f"{tiny_llama.name} mlx-lm batch 2",
                                                    f"{tiny_llama.name} mlxcel batch 2"]


def test_reduce_variants_alternate_at_tp_n(tiny_llama, tmp_path, capsys):
    out = tmp_path / "rows.jsonl"
    assert tp_bench.main(["-m", str(tiny_llama), "--tp", "2", "--batch", "1", "--warmup", "1", "--steps", "2",
                          "--impl", "mlx-lm", "--variants", "model,bfloat16", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["variant"], r["tp"]) for r in rows] == [("model", 2), ("bfloat16", 2), ("bfloat16", 2), ("model", 2)]
    assert rows[0]["tokens_sha256"] == rows[3]["tokens_sha256"]  # the same variant, the same greedy tokens
    assert "tp2 model" in capsys.readouterr().out


def test_refuses_tp_1():
    with pytest.raises(SystemExit):
        tp_bench.main(["--tp", "1"])


@pytest.mark.parametrize("argv", [["--variants", "model"], ["--variants", "model,model"],
                                  ["--variants", "model,float8"], ["--variants", "model,no-reduce"]])
def test_refuses_bad_variants(argv, capsys):
    with pytest.raises(SystemExit):
        tp_bench.main(["--tp", "2", *argv])
    assert "--variants" in capsys.readouterr().err
