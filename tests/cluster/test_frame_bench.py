"""The frame benchmark runs end to end (tiny sizes) and writes JSONL and CSV."""

from __future__ import annotations

import csv
import json

import pytest

from bench import frame_bench

pytestmark = [pytest.mark.timeout(120), pytest.mark.proc]


def test_frame_bench_quick(tmp_path, capsys):
    out = tmp_path / "fb.jsonl"
    assert frame_bench.main(["--quick", "--sizes", "8192,70000", "--rounds", "2", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert {r["suite"] for r in rows} == {"unprotected", "hmac_sha256", "aes_256_gcm", "chacha20_poly1305"}
    assert all(r["p50_us"] > 0 and r["iterations"] >= 10 and "env" in r for r in rows)
    with (tmp_path / "fb.csv").open() as fh:
        assert len(list(csv.DictReader(fh))) == len(rows)
    assert "One-way bandwidth" in capsys.readouterr().out
