"""The frame-protection decode table: protected (AES-256-GCM) against attribution-only unprotected
greedy decode of the 2-stage remote pipeline (bench/protection_bench.py), one row per benchmark run.

The benchmark writes its own summary row (medians, the ratio of medians, the per-round ratios' median
and range); this table shows those rows with their session, machine and label.
"""

from __future__ import annotations

import pandas as pd

from mlxcel.report import html

COLUMNS = ["session", "machine", "label", "model", "tokens_requested", "runs", "protected_tok_s", "protected_tok_s_min",
           "protected_tok_s_max", "unprotected_tok_s", "unprotected_tok_s_min", "unprotected_tok_s_max", "ratio",
           "ratio_median", "ratio_min", "ratio_max", "cost_ms_per_token", "identical", "load_1m_max"]


def protection_summary(df: pd.DataFrame) -> pd.DataFrame:
    """One row per benchmark run (its summary row), oldest session first."""
    if df.empty:
        return pd.DataFrame()
    return df.sort_values(["session", "machine"])[[c for c in COLUMNS if c in df]].reset_index(drop=True)


def protection_table(df: pd.DataFrame) -> html.Table:
    return html.table(df, [
        ("session", "session", html.text), ("machine", "machine", html.text), ("label", "label", html.text),
        ("model", "model", html.text), ("tokens", "tokens_requested", html.num(0)), ("rounds", "runs", html.num(0)),
        ("protected tok/s", "protected_tok_s", html.num(2)),
        ("protected range", ("protected_tok_s_min", "protected_tok_s_max"), html.spread(2)),
        ("unprotected tok/s", "unprotected_tok_s", html.num(2)),
        ("unprotected range", ("unprotected_tok_s_min", "unprotected_tok_s_max"), html.spread(2)),
        ("protected / unprotected (medians)", "ratio", html.num(3)),
        ("per-round ratio (median)", "ratio_median", html.num(3)),
        ("per-round ratio range", ("ratio_min", "ratio_max"), html.spread(3)),
        ("cost (ms/token)", "cost_ms_per_token", html.num(2)), ("identical tokens", "identical", html.text),
        ("load (1 min, max)", "load_1m_max", html.num(2)),
    ])
