"""The "How cost grows" section: bench/scaling_bench.py's rows summarized per size, the per-unit fits
(ms/token per added stage, bring-up seconds and bytes per peer, router CPU per node) and their plots.

Every size is summarized as median and range over its rounds; the fits run over every row (not the
medians), so their standard errors carry the round-to-round spread.
"""

from __future__ import annotations

from typing import Any

import pandas as pd
from matplotlib.figure import Figure

from mlxcel.report import html
from mlxcel.report.fits import fit
from mlxcel.report.plots import Plot, _errorbar, _render, color
from mlxcel.report.tables import spreads

_KEYS = ["session", "machine", "model"]

#: (fit name, table, x, y, degree, unit of the slope)
FITS = (
    ("ms/token per stage (1 stream)", "scaling_pipeline", "stages", "ms_per_token", 1, "ms"),
    ("bring-up s per peer (to serving)", "scaling_bringup", "peers", "ready_s", 1, "s"),
    ("push s per peer", "scaling_bringup", "peers", "push_s", 1, "s"),
    ("assignment bytes per peer (+ quadratic)", "scaling_bringup", "peers", "wire_bytes", 2, "B"),
    ("router CPU s per request per node", "scaling_router", "nodes", "router_cpu_s_per_request", 1, "s"),
    ("router added p95 ms per node", "scaling_router", "nodes", "added_ms_p95", 1, "ms"),
)


def _num(df: pd.DataFrame, name: str) -> pd.Series:
    return pd.to_numeric(df[name], errors="coerce") if name in df else pd.Series(float("nan"), index=df.index)


def pipeline_summary(df: pd.DataFrame) -> pd.DataFrame:
    """Per model, stages and streams: ms/token and tok/s (median, range), coordinator CPU per token."""
    if df.empty:
        return pd.DataFrame()
    df = df.assign(coord_cpu_ms_per_token=_num(df, "cpu_s_coordinator") * 1e3 / _num(df, "tokens"))
    out = spreads(df, [*_KEYS, "stages", "streams"], ("ms_per_token", "tok_s", "coord_cpu_ms_per_token"))
    return out.sort_values([*_KEYS, "streams", "stages"]).reset_index(drop=True)


def bringup_summary(df: pd.DataFrame) -> pd.DataFrame:
    """Per model and peer count: time to serving and push time (median, range), bytes, peers' RSS."""
    if df.empty:
        return pd.DataFrame()
    df = df.assign(peer_rss_mib=_num(df, "peer_rss_bytes") / 2**20)
    out = spreads(df, [*_KEYS, "peers"], ("ready_s", "push_s", "wire_bytes", "peer_rss_mib"))
    return out.sort_values([*_KEYS, "peers"]).reset_index(drop=True)


def router_summary(df: pd.DataFrame) -> pd.DataFrame:
    """Per model and prefill x decode: router CPU ms per request and added p95 (median, range)."""
    if df.empty:
        return pd.DataFrame()
    df = df.assign(router_cpu_ms=_num(df, "router_cpu_s_per_request") * 1e3)
    out = spreads(df, [*_KEYS, "prefill_nodes", "decode_nodes", "nodes"], ("router_cpu_ms", "added_ms_p95"))
    return out.sort_values([*_KEYS, "nodes", "prefill_nodes"]).reset_index(drop=True)


def fit_summary(tables: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """One row per session, machine, model and fit: slope with its standard error, intercept, r^2, n.

    The pipeline fit uses 1-stream rows of 2+ stages (the single node is the S=1 baseline beside it);
    a fit with fewer distinct sizes than it needs is left out."""
    rows: list[dict[str, Any]] = []
    for name, table, x, y, degree, unit in FITS:
        df = tables.get(table, pd.DataFrame())
        if df.empty or y not in df:
            continue
        if table == "scaling_pipeline":
            df = df[(df["streams"] == 1) & (df["stages"] >= 2)]
        for key, g in df.groupby(_KEYS, sort=False):
            g = g.dropna(subset=[x, y])
            if g[x].nunique() <= degree:
                continue
            f = fit(list(g[x].astype(float)), list(g[y].astype(float)), degree)
            rows.append({**dict(zip(_KEYS, key)), "fit": name, "unit": unit, "slope": f.slope, "slope_se": f.slope_se,
                         "intercept": f.intercept, "quadratic": f.coef[2] if degree == 2 else None, "r2": f.r2,
                         "n": f.n, "sizes": ", ".join(str(int(v)) for v in sorted(g[x].unique()))})
    return pd.DataFrame(rows)


def _se(slope: Any, se: Any) -> str:
    return html.num(3)(slope) + ("" if html._missing(se) else f" ± {html.num(3)(se)}")


def fit_table(df: pd.DataFrame) -> html.Table:
    return html.table(df, [
        ("model", "model", html.text), ("machine", "machine", html.text), ("fit", "fit", html.text),
        ("unit", "unit", html.text), ("slope ± s.e.", ("slope", "slope_se"), _se),
        ("intercept", "intercept", html.num(3)), ("x^2 term", "quadratic", html.num(3)), ("r^2", "r2", html.num(3)),
        ("rows", "n", html.num(0)), ("sizes", "sizes", html.text)])


def pipeline_table(df: pd.DataFrame) -> html.Table:
    return html.table(df, [
        ("model", "model", html.text), ("stages", "stages", html.num(0)), ("streams", "streams", html.num(0)),
        ("ms/token (median)", "ms_per_token_median", html.num(2)),
        ("ms/token range", ("ms_per_token_min", "ms_per_token_max"), html.spread(2)),
        ("tok/s (median)", "tok_s_median", html.num(1)), ("tok/s range", ("tok_s_min", "tok_s_max"), html.spread(1)),
        ("coordinator CPU ms/token", "coord_cpu_ms_per_token_median", html.num(2)), ("rounds", "tok_s_n", html.num(0))])


def bringup_table(df: pd.DataFrame) -> html.Table:
    return html.table(df, [
        ("model", "model", html.text), ("peers", "peers", html.num(0)), ("to serving (s)", "ready_s_median", html.num(2)),
        ("range", ("ready_s_min", "ready_s_max"), html.spread(2)), ("push (s)", "push_s_median", html.num(3)),
        ("assignment bytes", "wire_bytes_median", html.num(0)), ("peers' RSS (MiB)", "peer_rss_mib_median", html.num(0)),
        ("rounds", "ready_s_n", html.num(0))])


def router_table(df: pd.DataFrame) -> html.Table:
    return html.table(df, [
        ("model", "model", html.text), ("prefill", "prefill_nodes", html.num(0)), ("decode", "decode_nodes", html.num(0)),
        ("router CPU ms/request", "router_cpu_ms_median", html.num(2)),
        ("range", ("router_cpu_ms_min", "router_cpu_ms_max"), html.spread(2)),
        ("added p95 (ms)", "added_ms_p95_median", html.num(1)),
        ("range ", ("added_ms_p95_min", "added_ms_p95_max"), html.spread(1)), ("rounds", "router_cpu_ms_n", html.num(0))])


def scaling_plot(pipe: pd.DataFrame, bringup: pd.DataFrame, fits: pd.DataFrame, title: str) -> Plot:
    """ms/token against stages (1 stream, with the fit line; S=1 is the single node) and time to serving
    against peers (median, min-max bars)."""
    fig = Figure(figsize=(12, 3.9), layout="constrained")
    ax_p, ax_b = fig.subplots(1, 2)
    one = pipe[pipe["streams"] == 1] if not pipe.empty else pipe
    for i, (model, g) in enumerate(one.groupby("model", sort=False) if not one.empty else []):
        _errorbar(ax_p, g["stages"], g["ms_per_token_median"], g["ms_per_token_min"], g["ms_per_token_max"],
                  color=color(model, i), label=model)
        f = fits[(fits["model"] == model) & (fits["fit"] == FITS[0][0])] if not fits.empty else fits
        if not f.empty:
            xs = [x for x in sorted(g["stages"]) if x >= 2]
            ax_p.plot(xs, [f["intercept"].iloc[0] + f["slope"].iloc[0] * x for x in xs], linestyle=":",
                      color=color(model, i), label=f"fit: {f['slope'].iloc[0]:.2f} ms per stage")
    ax_p.set_xlabel("pipeline stages (1 = single node)")
    ax_p.set_ylabel("ms per token, 1 stream")
    ax_p.set_title("per-hop cost")
    for i, (model, g) in enumerate(bringup.groupby("model", sort=False) if not bringup.empty else []):
        _errorbar(ax_b, g["peers"], g["ready_s_median"], g["ready_s_min"], g["ready_s_max"], color=color(model, i),
                  label=model)
    ax_b.set_xlabel("--pp-auto peers")
    ax_b.set_ylabel("seconds from coordinator start to serving")
    ax_b.set_title("bring-up time")
    for ax in (ax_p, ax_b):
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=11)
    return _render(fig, title, f"ms per token against pipeline stages and bring-up time against peers: {title}")


def summaries(tables: dict[str, pd.DataFrame]) -> dict[str, pd.DataFrame]:
    """The section's tables by CSV name."""
    return {"scaling_pipeline_summary": pipeline_summary(tables.get("scaling_pipeline", pd.DataFrame())),
            "scaling_bringup_summary": bringup_summary(tables.get("scaling_bringup", pd.DataFrame())),
            "scaling_router_summary": router_summary(tables.get("scaling_router", pd.DataFrame())),
            "scaling_fits": fit_summary(tables)}


def section(s: dict[str, pd.DataFrame]) -> dict[str, Any] | None:
    """The template's context for the section, or None without scaling rows."""
    if all(df.empty for df in s.values()):
        return None
    pipe, bringup, router, fits = (s[k] for k in ("scaling_pipeline_summary", "scaling_bringup_summary",
                                                   "scaling_router_summary", "scaling_fits"))
    return {"plot": scaling_plot(pipe, bringup, fits, "How cost grows (loopback)"),
            "fits": fit_table(fits) if not fits.empty else None,
            "pipeline": pipeline_table(pipe) if not pipe.empty else None,
            "bringup": bringup_table(bringup) if not bringup.empty else None,
            "router": router_table(router) if not router.empty else None}
