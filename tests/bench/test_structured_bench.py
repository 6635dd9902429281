"""bench/structured_bench.py's summary: per-round ratios json_schema / plain with their mean and range, the per-token
cost, whether both sides generated the same tokens; its rows are what the report's schema accepts."""

from __future__ import annotations

import pytest

from bench.structured_bench import RESPONSE_FORMAT, extra_body, summaries
from mlxcel.report.schema import validate_row


def row(mode: str, rnd: int, tps: float, itl: float, n: int = 32, tokens: int = 48) -> dict:
    return {"bench": "structured_output", "mode": mode, "label": "t", "model": "m", "concurrency": n, "round": rnd,
            "order": 0, "requests": 2, "errors": 0, "error_sample": "", "max_tokens": 48, "output_tokens": 2 * tokens,
            "tokens_min": tokens, "tokens_max": tokens, "wall_s": 1.0, "agg_tps": tps, "itl_p50_ms": itl,
            "itl_mean_ms": itl, "ttft_p50_ms": 5.0, "prompts_sha256": "c" * 64, "load_1m": 1.0 + rnd, "load_5m": 2.0}


def test_the_ratios_are_per_round_with_their_spread() -> None:
    rows = [row("plain", 0, 100.0, 10.0), row("json_schema", 0, 90.0, 11.0),
            row("json_schema", 1, 95.0, 10.0), row("plain", 1, 100.0, 10.0)]
    (s,) = summaries(rows)
    assert (s["rounds"], s["same_tokens"]) == (2, True)
    assert (s["tps_ratio"], s["tps_ratio_min"], s["tps_ratio_max"]) == pytest.approx((0.925, 0.9, 0.95))
    assert (s["itl_ratio"], s["itl_ratio_min"], s["itl_ratio_max"]) == pytest.approx((1.05, 1.0, 1.1))
    assert s["cost_pct"] == pytest.approx(5.0) and s["load_1m_max"] == 2.0
    for r in [*rows, s]:
        validate_row({**r, "env": {}})


def test_a_side_that_generated_fewer_tokens_is_flagged() -> None:
    rows = [row("plain", 0, 100.0, 10.0), row("json_schema", 0, 90.0, 11.0, tokens=30)]
    assert summaries(rows)[0]["same_tokens"] is False


def test_only_the_schema_side_sends_the_response_format() -> None:
    assert extra_body("plain") is None
    assert extra_body("json_schema") == {"response_format": RESPONSE_FORMAT}
    assert RESPONSE_FORMAT["json_schema"]["schema"]["properties"]["items"]["minItems"] * 8 > 48  # longer than the run
