"""The structured output table: one server's tokens/s with a JSON schema (response_format, the grammar's token
mask) against without, same prompts, ABBA (bench/structured_bench.py), one row per concurrency level and run.

The benchmark writes its own summary rows (per-round ratios json_schema / plain of aggregate tok/s and of the mean
gap between streamed tokens, their mean and range, and the per-token cost in percent); this table shows them with
their session, machine, label and the host's load.
"""

from __future__ import annotations

import pandas as pd

from mlxcel.report import html

COLUMNS = ["session", "machine", "label", "model", "concurrency", "max_tokens", "rounds", "same_tokens", "plain_tps",
           "schema_tps", "tps_ratio", "tps_ratio_min", "tps_ratio_max", "plain_itl_ms", "schema_itl_ms", "itl_ratio",
           "itl_ratio_min", "itl_ratio_max", "cost_pct", "load_1m_max"]


def structured_summary(df: pd.DataFrame) -> pd.DataFrame:
    """One row per level and benchmark run (its summary row), oldest session first, then by level."""
    if df.empty:
        return pd.DataFrame()
    keys = [k for k in ("session", "machine", "concurrency") if k in df]
    return df.sort_values(keys)[[c for c in COLUMNS if c in df]].reset_index(drop=True)


def structured_table(df: pd.DataFrame) -> html.Table:
    return html.table(df, [
        ("session", "session", html.text), ("machine", "machine", html.text), ("label", "label", html.text),
        ("model", "model", html.text), ("streams", "concurrency", html.num(0)), ("tokens", "max_tokens", html.num(0)),
        ("rounds", "rounds", html.num(0)), ("same tokens", "same_tokens", html.text),
        ("plain tok/s", "plain_tps", html.num(2)), ("json_schema tok/s", "schema_tps", html.num(2)),
        ("tok/s ratio (mean)", "tps_ratio", html.num(3)),
        ("tok/s ratio range", ("tps_ratio_min", "tps_ratio_max"), html.spread(3)),
        ("plain gap (ms)", "plain_itl_ms", html.num(2)), ("json_schema gap (ms)", "schema_itl_ms", html.num(2)),
        ("gap ratio (mean)", "itl_ratio", html.num(3)),
        ("gap ratio range", ("itl_ratio_min", "itl_ratio_max"), html.spread(3)),
        ("cost per token (%)", "cost_pct", html.num(2)), ("load (1 min, max)", "load_1m_max", html.num(2)),
    ])
