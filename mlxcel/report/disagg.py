"""Summary tables of the disaggregated rows (bench/disagg_bench.py): the KV handoff per request,
its frames protected and unprotected, and serving through router + prefill + decode against the
single node (the ``hybrid`` topology) of the same run.

Ratios against the single node are taken per pairing (a serve round, a handoff repeat: both sides
ran in ABBA order within it), then summarized as median and range, like every spread of the report.
"""

from __future__ import annotations

import pandas as pd

from mlxcel.report.tables import same_prompts, spread

SINGLE = "hybrid"  # the topology every other one is held against


def topology_label(name: object) -> str:
    """"1p2d" -> "1 prefill + 2 decode"; the hybrid node is the single node."""
    text = str(name)
    if text == SINGLE:
        return "single node (hybrid)"
    head, _, tail = text.partition("p")
    if head.isdigit() and tail.endswith("d") and tail[:-1].isdigit():
        return f"{head} prefill + {tail[:-1]} decode"
    return text


def _column(df: pd.DataFrame, name: str) -> pd.Series:
    """A column that older rows may lack, as NaN where absent."""
    return pd.to_numeric(df[name], errors="coerce") if name in df else pd.Series(float("nan"), index=df.index)


def _vs_single(df: pd.DataFrame, keys: list[str], pair: str, value: str, name: str) -> pd.DataFrame:
    """Per ``keys`` + topology: ``value`` over the single node's in the same ``pair`` (round or repeat),
    median/min/max/n over the pairs; no rows for the single node itself or where it is missing."""
    single = df[df["topology"] == SINGLE].groupby([*keys, pair], dropna=False)[value].median()
    idx = pd.MultiIndex.from_frame(df[[*keys, pair]])
    others = df.assign(**{name: df[value].values / single.reindex(idx).values})
    others = others[(others["topology"] != SINGLE) & others[name].notna()]
    if others.empty:
        return pd.DataFrame(columns=[*keys, "topology", *(f"{name}_{s}" for s in ("median", "min", "max", "n"))])
    return spread(others, [*keys, "topology"], name)


def _load_range(df: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """The 1-minute load average's min and max per group (NaN for rows that did not record it)."""
    load = df.assign(load_1m=_column(df, "load_1m"))
    g = load.groupby(keys, dropna=False, sort=False)["load_1m"]
    return g.agg(load_1m_min="min", load_1m_max="max").reset_index()


def frames_summary(df: pd.DataFrame) -> pd.DataFrame:
    """One row per session, dtype, prompt length and suite: a handoff's tensor bytes, p50/p95 time,
    GiB/s at p50 and the p50 over the unprotected suite's (the rows carry it)."""
    if df.empty:
        return pd.DataFrame()
    out = df.assign(protected=df["suite"] != "unprotected", load_1m=_column(df, "load_1m"))
    cols = ["session", "machine", "dtype", "prompt_tokens", "suite", "protected", "tensor_bytes", "repeats",
            "p50_ms", "p95_ms", "gib_s", "vs_unprotected", "load_1m"]
    return out.sort_values(["session", "dtype", "prompt_tokens", "protected"])[cols].reset_index(drop=True)


def handoff_summary(df: pd.DataFrame) -> pd.DataFrame:
    """Per session, prompt length and topology: TTFT and end-to-end time over the repeats, the
    handoff's bytes, stream time and GiB/s (router + prefill + decode only), and TTFT over the
    single node's in the same repeat."""
    if df.empty:
        return pd.DataFrame()
    df = df.assign(**{c: _column(df, c) for c in ("handoff_bytes", "handoff_ms", "handoff_gib_s", "prefill_ms")})
    keys = ["session", "machine", "target_prompt_tokens"]
    by = [*keys, "topology"]
    out = spread(df, by, "ttft_ms")
    for value in ("handoff_ms", "handoff_gib_s"):
        out = out.merge(spread(df, by, value), on=by, how="left")
    g = df.groupby(by, sort=False, dropna=False)
    extra = pd.DataFrame({
        "prompt_tokens": g["prompt_tokens"].median(), "e2e_ms_median": g["e2e_ms"].median(),
        "handoff_bytes_median": g["handoff_bytes"].median(), "prefill_ms_median": g["prefill_ms"].median(),
        "repeats": g["repeat"].nunique(),
    }).reset_index()
    out = out.merge(extra, on=by, how="left").merge(_vs_single(df, keys, "repeat", "ttft_ms", "ttft_vs_single"),
                                                    on=by, how="left")
    out = out.merge(_load_range(df, by), on=by, how="left")
    out["topology_label"] = out["topology"].map(topology_label)
    return out.sort_values(["session", "target_prompt_tokens", "topology"], key=_single_first).reset_index(drop=True)


def serve_summary(df: pd.DataFrame) -> pd.DataFrame:
    """Per session, prompt kind, output length, concurrency and topology: TTFT, ITL and aggregate
    tok/s over the rounds, handoffs per request, and tok/s, TTFT and ITL over the single node's in the
    same round (median and range over rounds); ``server`` is the topology's label (serve_plot draws it)."""
    if df.empty:
        return pd.DataFrame()
    df = df.assign(prompt=df["prompt"].fillna("short") if "prompt" in df else "short",
                   arrival=df["arrival"].fillna("herd"),
                   **{c: _column(df, c) for c in ("handoff_bytes_mean", "handoff_ms_mean", "long_tokens")})
    keys = ["session", "machine", "prompt", "max_tokens", "concurrency"]
    by = [*keys, "topology"]
    out = spread(df, by, "ttft_p50_ms")
    for value in ("itl_p50_ms", "agg_tps", "handoff_ms_mean"):
        out = out.merge(spread(df, by, value), on=by, how="left")
    g = df.groupby(by, sort=False, dropna=False)
    extra = pd.DataFrame({
        "ttft_p95_ms_median": g["ttft_p95_ms"].median(), "itl_p95_ms_median": g["itl_p95_ms"].median(),
        "handoff_bytes_mean_median": g["handoff_bytes_mean"].median(), "long_tokens": g["long_tokens"].max(),
        "requests": g["requests"].sum(), "errors": g["errors"].sum(), "rounds": g["round"].nunique(),
    }).reset_index()
    out = out.merge(extra, on=by, how="left").merge(_load_range(df, by), on=by, how="left")
    for value, name in (("agg_tps", "tps_vs_single"), ("ttft_p50_ms", "ttft_vs_single"),
                        ("itl_p50_ms", "itl_vs_single")):
        out = out.merge(_vs_single(df, keys, "round", value, name), on=by, how="left")
    out["server"] = out["topology"].map(topology_label)
    out["arrival"] = out.apply(lambda r: df.loc[_same(df, r, keys), "arrival"].iloc[0], axis=1)
    out["same_prompts"] = out.apply(lambda r: same_prompts(df[_same(df, r, ["session", "prompt", "max_tokens"])], r),
                                    axis=1)
    return out.sort_values(["session", "prompt", "concurrency", "topology"], key=_single_first).reset_index(drop=True)


def _same(df: pd.DataFrame, row: pd.Series, keys: list[str]) -> pd.Series:
    """The rows of ``df`` that share ``row``'s values on ``keys``."""
    mask = pd.Series(True, index=df.index)
    for k in keys:
        mask &= df[k] == row[k]
    return mask


def _single_first(s: pd.Series) -> pd.Series:
    """Sort key: the single node before the topologies held against it, others alphabetically."""
    return s.map(lambda t: "" if t == SINGLE else str(t)) if s.name == "topology" else s
