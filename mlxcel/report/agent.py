"""The multi-turn agent tables (bench/agent_turns.py): TTFT per turn by variant, and the benchmark's own summary
rows (turn 1 and turns >= 2 per variant, against the single node's cached turns) and ratio rows (round-robin over
prefix-aware routing).

Per turn, TTFT is the median over every conversation and repeat with its range; prefix reuse is the waves' cached
tokens (the serving processes' /metrics) over the tokens the conversations' previous turns held.
"""

from __future__ import annotations

import pandas as pd

from mlxcel.report import html
from mlxcel.report.tables import spreads

GOAL_VS_SINGLE = 1.2  # turns >= 2: TTFT within 1.2x of the single node's cached turns
GOAL_RR_OVER_PREFIX = 3.0  # round-robin's later-turn TTFT at least 3x prefix-aware routing's


def _num(df: pd.DataFrame, name: str) -> pd.Series:
    return pd.to_numeric(df[name], errors="coerce") if name in df else pd.Series(float("nan"), index=df.index)


def turn_summary(df: pd.DataFrame) -> pd.DataFrame:
    """Per session, machine, variant and turn: TTFT and decode tok/s over conversations and repeats (median,
    min, max), median prompt tokens, prefix reuse, requests and errors; variants in the order they first ran."""
    if df.empty:
        return pd.DataFrame()
    df = df.assign(ttft_ms=_num(df, "ttft_ms"), decode_tps=_num(df, "decode_tps"), prompt_tokens=_num(df, "prompt_tokens"),
                   wave_cached_tokens=_num(df, "wave_cached_tokens"), failed=df["error"].fillna("").astype(bool)
                   if "error" in df else False)
    keys = ["session", "machine", "conversations", "variant", "turn"]
    out = spreads(df, keys, ("ttft_ms", "decode_tps"))
    g = df.groupby(keys, sort=False, dropna=False)
    waves = df.drop_duplicates([*keys, "run", "repeat"]).groupby(keys, sort=False, dropna=False)
    extra = pd.DataFrame({
        "prompt_tokens_median": g["prompt_tokens"].median(), "requests": g["turn"].size(), "errors": g["failed"].sum(),
        "repeats": g["repeat"].nunique(), "topology": g["topology"].first(),
        "cached_tokens": waves["wave_cached_tokens"].sum(min_count=1),
        "reusable_tokens": waves["wave_reusable_tokens"].sum(),
    }).reset_index()
    out = out.merge(extra, on=keys, how="left")
    out["reuse"] = out["cached_tokens"] / out["reusable_tokens"].where(out["reusable_tokens"] > 0)
    return out.sort_values(["session", "machine", "conversations", "turn"], kind="stable").reset_index(drop=True)


def variant_summary(summary: pd.DataFrame, ratio: pd.DataFrame) -> pd.DataFrame:
    """The benchmark's summary rows with whether each met its goal; ratio rows after them, as tables show them."""
    if summary.empty:
        return pd.DataFrame()
    out = summary.assign(goal_met=[_goal(v, b, n) for v, b, n in zip(_num(summary, "vs_baseline"), summary["baseline"],
                                                                       summary["variant"])])
    if not ratio.empty:
        met = _num(ratio, "ratio") >= GOAL_RR_OVER_PREFIX
        ratio = ratio.assign(goal_met=met.map({True: "yes", False: "no"}).where(_num(ratio, "ratio").notna(), "–"))
        out = pd.concat([out, ratio], ignore_index=True)
    for column in _SUMMARY_COLUMNS:  # ratio rows lack the summary's columns, and a run without pairs the ratio's
        if column not in out:
            out[column] = None
    keys = [k for k in ("session", "machine", "conversations") if k in out]
    return out.sort_values(keys, kind="stable").reset_index(drop=True)


_SUMMARY_COLUMNS = ("topology", "args", "repeats", "prompt_tokens_max", "errors", "denominator", "ratio", "ratio_min",
                    "ratio_max", *(f"{m}{s}" for m in ("ttft_turn1_ms", "ttft_later_ms", "vs_baseline", "reuse",
                                                        "decode_tps") for s in ("", "_min", "_max")))


def share(v: object) -> str:
    """A fraction as a percentage (prefix reuse), "–" where there is none."""
    return "–" if html._missing(v) else f"{float(v):.1%}"  # type: ignore[arg-type]


def _goal(vs: float, baseline: str, variant: str) -> str:
    if variant == baseline or pd.isna(vs):
        return "–"
    return "yes" if vs <= GOAL_VS_SINGLE else "no"


def turn_table(df: pd.DataFrame) -> html.Table:
    return html.table(df, [
        ("variant", "variant", html.text), ("topology", "topology", html.text), ("turn", "turn", html.num(0)),
        ("prompt tokens", "prompt_tokens_median", html.num(0)), ("requests", "requests", html.num(0)),
        ("TTFT (ms)", "ttft_ms_median", html.num(1)), ("TTFT range", ("ttft_ms_min", "ttft_ms_max"), html.spread(1)),
        ("prefix tokens reused", "cached_tokens", html.num(0)), ("reuse of previous turns", "reuse", share),
        ("decode tok/s", "decode_tps_median", html.num(1)), ("errors", "errors", html.num(0)),
    ], lambda r: "regression" if r["errors"] else "")


def summary_table(df: pd.DataFrame) -> html.Table:
    return html.table(df, [
        ("variant", "variant", html.text), ("row", "mode", html.text), ("topology", "topology", html.text),
        ("role args", "args", html.text), ("repeats", "repeats", html.num(0)),
        ("longest prompt", "prompt_tokens_max", html.num(0)),
        ("turn 1 TTFT (ms)", "ttft_turn1_ms", html.num(1)),
        ("turn 1 range", ("ttft_turn1_ms_min", "ttft_turn1_ms_max"), html.spread(1)),
        ("turns ≥ 2 TTFT (ms)", "ttft_later_ms", html.num(1)),
        ("turns ≥ 2 range", ("ttft_later_ms_min", "ttft_later_ms_max"), html.spread(1)),
        ("vs single node, turns ≥ 2", "vs_baseline", html.ratio),
        ("vs single range", ("vs_baseline_min", "vs_baseline_max"), html.spread(2)),
        ("prefix reuse", "reuse", share), ("decode tok/s", "decode_tps", html.num(1)),
        ("over", "denominator", html.text), ("ratio (turns ≥ 2 TTFT)", "ratio", html.ratio),
        ("ratio range", ("ratio_min", "ratio_max"), html.spread(2)), ("goal met", "goal_met", html.text),
        ("errors", "errors", html.num(0)),
    ], lambda r: "regression" if r.get("goal_met") == "no" else "")
