"""The quantized KV cache's quality table: ``--kv-bits`` against full precision on one model
(bench/kv_bits_quality.py), one summary row per bits and run: identical texts, greedy agreement, top-1 agreement
under teacher forcing, logit errors and KV bytes per token.
"""

from __future__ import annotations

import pandas as pd

from mlxcel.report import html

COLUMNS = ["session", "machine", "model", "bits", "group_size", "prompts", "tokens", "identical_texts", "agree",
           "top1_agree", "max_logit_err", "mean_logit_err", "kv_bytes_per_token", "kv_bytes_per_token_full"]


def quality_summary(df: pd.DataFrame) -> pd.DataFrame:
    """The summary rows, oldest session first, then by bits (most first)."""
    if df.empty:
        return pd.DataFrame()
    keys = [k for k in ("session", "machine") if k in df]
    ordered = df.sort_values(keys + ["bits"], ascending=[True] * len(keys) + [False])
    return ordered[[c for c in COLUMNS if c in df]].reset_index(drop=True)


def quality_table(df: pd.DataFrame) -> html.Table:
    return html.table(df, [
        ("session", "session", html.text), ("machine", "machine", html.text), ("model", "model", html.text),
        ("KV bits", "bits", html.num(0)), ("group", "group_size", html.num(0)), ("prompts", "prompts", html.num(0)),
        ("tokens", "tokens", html.num(0)), ("identical texts", "identical_texts", html.num(0)),
        ("greedy agreement", "agree", html.num(3)), ("top-1 agreement (teacher forced)", "top1_agree", html.num(3)),
        ("max logit error", "max_logit_err", html.num(3)), ("mean logit error", "mean_logit_err", html.num(3)),
        ("KV bytes/token", "kv_bytes_per_token", html.num(0)),
        ("full precision", "kv_bytes_per_token_full", html.num(0)),
    ])
