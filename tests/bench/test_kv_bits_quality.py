"""``bench/kv_bits_quality.py`` on a tiny checkpoint: its rows and table, and the memory it reports."""

from __future__ import annotations

from bench.kv_bits_quality import run, table
from tests.engine.test_kv_bits import make_llama


def test_rows_compare_each_width_with_full_precision(tmp_path_factory):
    rows = run(str(make_llama(tmp_path_factory, "kv-bench")), 3, [4, 8], 32, 2)
    summaries = {r["bits"]: r for r in rows if r["kind"] == "summary"}
    assert len([r for r in rows if r["kind"] == "prompt"]) == 4 and set(summaries) == {4, 8}
    # 4 layers x K,V x 2 heads: float32 32 x 4 B = 128 B; 8-bit 32 B + scale and bias 8 B; 4-bit 16 + 8 B
    assert summaries[8]["kv_bytes_per_token_full"] == 4 * 2 * 2 * 128
    assert (summaries[8]["kv_bytes_per_token"], summaries[4]["kv_bytes_per_token"]) == (4 * 2 * 2 * 40, 4 * 2 * 2 * 24)
    assert 0 < summaries[8]["max_logit_err"] < summaries[4]["max_logit_err"]
    assert "| 8-bit, group 32 |" in table(rows) and "| full precision |" in table(rows)
