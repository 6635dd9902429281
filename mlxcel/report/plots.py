"""Charts for the report: matplotlib figures (no pyplot state, Agg canvas) as base64 PNG.

Every chart has a title, axis labels with units and a legend; the spread of repeated runs is
drawn as min-to-max error bars around the median.
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass
from typing import Any

import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter, NullLocator

SUITE_LABELS = {"unprotected": "unprotected", "hmac_sha256": "HMAC-SHA256", "aes_256_gcm": "AES-256-GCM",
                "chacha20_poly1305": "ChaCha20-Poly1305"}
_PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"]
_COLORS = {"unprotected": "#7f7f7f", "hmac_sha256": "#ff7f0e", "aes_256_gcm": "#2ca02c",
           "chacha20_poly1305": "#9467bd", "mlxcel": "#1f77b4", "mlx-lm": "#d62728", "mlx_lm": "#d62728"}


@dataclass(frozen=True)
class Plot:
    title: str
    alt: str
    png_base64: str


def color(name: str, i: int = 0) -> str:
    return _COLORS.get(name, _PALETTE[i % len(_PALETTE)])


def _render(fig: Figure, title: str, alt: str) -> Plot:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=96)  # constrained layout already fits the labels
    return Plot(title, alt, base64.b64encode(buf.getvalue()).decode("ascii"))


def _size_label(n: float) -> str:
    return f"{int(n // 2**20)} MiB" if n >= 2**20 else f"{int(n // 1024)} KiB" if n >= 1024 else f"{int(n)} B"


def _payload_axis(ax, sizes: list[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(sorted(set(sizes))))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: _size_label(v)))
    ax.tick_params(axis="x", labelrotation=35, labelsize=8)
    ax.set_xlabel("payload per message")
    ax.grid(True, which="major", alpha=0.3)


def _errorbar(ax, x, med, lo, hi, **kw) -> None:
    yerr = [(med - lo).clip(lower=0).values, (hi - med).clip(lower=0).values]
    ax.errorbar(x, med, yerr=yerr, capsize=3, marker="o", markersize=4, **kw)


def frame_plot(df: pd.DataFrame, title: str) -> Plot:
    """Latency, bandwidth and p50 overhead against payload, one line per candidate."""
    fig = Figure(figsize=(13, 3.9), layout="constrained")
    ax_lat, ax_bw, ax_ov = fig.subplots(1, 3)
    for i, (suite, g) in enumerate(df.sort_values("payload_bytes").groupby("suite", sort=False)):
        label, c = SUITE_LABELS.get(suite, suite), color(suite, i)
        ax_lat.plot(g["payload_bytes"], g["p50_us"], marker="o", color=c, label=f"{label} p50")
        if "p95_us" in g:
            ax_lat.plot(g["payload_bytes"], g["p95_us"], linestyle=":", color=c, alpha=0.7, label=f"{label} p95")
        ax_bw.plot(g["payload_bytes"], g["one_way_gib_s"], marker="o", color=c, label=label)
        if suite != "unprotected":
            ax_ov.plot(g["payload_bytes"], g["overhead_vs_unprotected"], marker="o", color=c, label=label)
    sizes = list(df["payload_bytes"])
    for ax in (ax_lat, ax_bw, ax_ov):
        _payload_axis(ax, sizes)
    ax_lat.set_yscale("log")
    ax_lat.set_ylabel("one-way latency (us, log scale)")
    ax_lat.set_title("latency vs payload")
    ax_lat.legend(fontsize=7, ncol=2)
    ax_bw.set_ylabel("one-way bandwidth at p50 (GiB/s)")
    ax_bw.set_title("bandwidth vs payload")
    ax_bw.legend(fontsize=8)
    _overhead_axis(ax_ov, "p50 latency / unprotected p50 (x)")
    fig.suptitle(title, fontsize=11)
    return _render(fig, title, f"Frame latency, bandwidth and overhead against payload size: {title}")


def _overhead_axis(ax: Any, ylabel: str) -> None:
    """The protection overhead panel: a ratio to unprotected, 1.0 marked; a legend once a protected line is drawn."""
    ax.axhline(1.0, color="#7f7f7f", linewidth=1, linestyle="--")
    ax.set_ylabel(ylabel)
    ax.set_title("protection overhead ratio")
    if ax.lines[1:]:
        ax.legend(fontsize=8)


def decode_plot(cmp: pd.DataFrame) -> Plot:
    """Decode tok/s of mlxcel and mlx-lm per session, median with min-max bars; one panel per machine
    (each with its own scale: a GPU and a 2-core CPU differ by 10x and more)."""
    machines = list(dict.fromkeys(cmp["machine"]))
    widths = [cmp["machine"].eq(m).sum() for m in machines]
    fig = Figure(figsize=(max(5.0, 2.4 * sum(widths) + 1.2 * len(machines)), 4.4), layout="constrained")
    axes = fig.subplots(1, len(machines), squeeze=False, width_ratios=widths)[0]
    for ax, machine in zip(axes, machines):
        part = cmp[cmp["machine"] == machine].reset_index(drop=True)
        x = pd.Series(range(len(part)), dtype=float)
        for off, (impl, label) in ((-0.2, ("mlxcel", "mlxcel")), (0.2, ("mlx_lm", "mlx-lm"))):
            med, lo, hi = (part[f"{impl}_decode_tps_{s}"] for s in ("median", "min", "max"))
            ax.bar(x + off, med, width=0.36, color=color(impl), label=label, alpha=0.85)
            ax.errorbar(x + off, med, yerr=[(med - lo).clip(lower=0), (hi - med).clip(lower=0)], fmt="none",
                        ecolor="black", capsize=3, linewidth=1)
        labels = [f"{r.model}, {r.weights}\nkv {r.kv}, ctx {r.context}\n{str(r.session).split('@')[-1].strip()[:16]}"
                  for r in part.itertuples()]
        ax.set_xticks(list(x), labels, fontsize=7)
        ax.set_xlim(-0.7, len(part) - 0.3)
        ax.set_title(machine, fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].set_ylabel("decode throughput (tok/s, median; bars: min-max)")
    axes[0].legend()
    fig.suptitle("Single-device decode: mlxcel vs mlx-lm", fontsize=11)
    return _render(fig, "decode", "Decode tokens per second of mlxcel and mlx-lm per benchmark session and machine")


def _concurrency_axis(ax, values, label: str) -> None:
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(sorted(set(values))))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{int(v)}"))
    ax.set_xlabel(label)
    ax.grid(True, alpha=0.3)


def serve_plot(df: pd.DataFrame, title: str) -> Plot:
    """TTFT, ITL and aggregate throughput against concurrency, one line per server."""
    fig = Figure(figsize=(13, 3.9), layout="constrained")
    axes = fig.subplots(1, 3)
    panels = (("ttft_p50_ms", "ttft_p95_ms_median", "time to first token (ms)", "TTFT"),
              ("itl_p50_ms", "itl_p95_ms_median", "inter-token latency (ms)", "ITL"),
              ("agg_tps", None, "aggregate output (tok/s)", "throughput"))
    for i, (server, g) in enumerate(df.sort_values("concurrency").groupby("server", sort=False)):
        c = color(server, i)
        for ax, (col, p95, _, _) in zip(axes, panels):
            _errorbar(ax, g["concurrency"], g[f"{col}_median"], g[f"{col}_min"], g[f"{col}_max"], color=c,
                      label=f"{server} p50" if p95 else server)
            if p95:
                ax.plot(g["concurrency"], g[p95], linestyle=":", color=c, alpha=0.8, label=f"{server} p95")
    for ax, (_, _, ylabel, name) in zip(axes, panels):
        _concurrency_axis(ax, df["concurrency"], "concurrent clients")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{name} vs concurrency")
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=11)
    return _render(fig, title, f"Serving TTFT, ITL and throughput against concurrency: {title}")


def pipeline_plot(df: pd.DataFrame, title: str) -> Plot:
    """tok/s against streams per topology (median, min-max bars), and bytes per token."""
    fig = Figure(figsize=(12, 3.9), layout="constrained")
    ax_t, ax_b = fig.subplots(1, 2, width_ratios=[3, 2])
    topo = df.assign(topology=df["mode"] + " (" + df["stages"].astype(str) + " stage" +
                     df["stages"].map(lambda s: "s" if s > 1 else "") + ", " + df["return"] + ")")
    for i, (name, g) in enumerate(topo.sort_values("streams").groupby("topology", sort=False)):
        _errorbar(ax_t, g["streams"], g["tok_s_median"], g["tok_s_min"], g["tok_s_max"], color=color(name, i),
                  label=name)
    _concurrency_axis(ax_t, df["streams"], "concurrent streams")
    ax_t.set_ylabel("decode throughput (tok/s, aggregate)")
    ax_t.set_title("tok/s per topology (median; bars: min-max)")
    ax_t.legend(fontsize=7)
    per = topo.dropna(subset=["bytes_per_token_median"]).groupby("topology", sort=False)["bytes_per_token_median"].median()
    if len(per):
        ax_b.barh(list(per.index), list(per.values / 1024), height=0.5,
                  color=[color(n, i) for i, n in enumerate(per.index)])
        ax_b.set_ylim(-0.75, len(per) - 0.25)
        ax_b.set_xlabel("wire bytes per decoded token (KiB)")
        ax_b.set_title("bytes per token (median over streams)")
        ax_b.tick_params(axis="y", labelsize=7)
        ax_b.grid(True, axis="x", alpha=0.3)
    else:
        ax_b.text(0.5, 0.5, "no bytes-per-token measured", ha="center", va="center")
        ax_b.set_axis_off()
    fig.suptitle(title, fontsize=11)
    return _render(fig, title, f"Pipeline throughput per topology and bytes per token: {title}")


def reference_pipeline_plot(ref: pd.DataFrame, title: str) -> Plot:
    """The reference's published pipeline rows as horizontal bars with their min-max range."""
    fig = Figure(figsize=(10, 2.8), layout="constrained")
    ax = fig.subplots()
    y = list(range(len(ref)))[::-1]
    med = ref["tok_s_median"]
    ax.barh(y, med, color=["#bbbbbb", "#bbbbbb", "#7f7f7f", "#2ca02c"][: len(ref)],
            xerr=[med - ref["tok_s_min"], ref["tok_s_max"] - med], capsize=3)
    for yi, v in zip(y, med):
        ax.text(v + 2, yi + 0.15, f"{v:.1f}", fontsize=8)
    ax.set_yticks(y, list(ref["variant"]), fontsize=8)
    ax.set_xlabel("decode throughput (tok/s, median of per-run medians; bars: min-max)")
    ax.grid(True, axis="x", alpha=0.3)
    fig.suptitle(title, fontsize=10)
    return _render(fig, title, "The reference's published two-stage pipeline decode throughput (other hardware)")


def _mb_axis(ax, label: str) -> None:
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel(label)
    ax.grid(True, which="major", alpha=0.3)


def handoff_plot(df: pd.DataFrame, title: str) -> Plot:
    """TTFT against prompt length per topology, and the handoff's stream time against its bytes
    (median, min-max bars), from ``disagg.handoff_summary``."""
    fig = Figure(figsize=(12, 3.9), layout="constrained")
    ax_t, ax_h = fig.subplots(1, 2)
    for i, (label, g) in enumerate(df.sort_values("prompt_tokens").groupby("topology_label", sort=False)):
        _errorbar(ax_t, g["prompt_tokens"], g["ttft_ms_median"] / 1000, g["ttft_ms_min"] / 1000,
                  g["ttft_ms_max"] / 1000, color=color(label, i), label=label)
    ax_t.set_xlabel("prompt tokens")
    ax_t.set_ylabel("time to first token (s)")
    ax_t.set_title("TTFT vs prompt length")
    ax_t.grid(True, alpha=0.3)
    ax_t.legend(fontsize=8)
    moved = df.dropna(subset=["handoff_bytes_median"]).sort_values("handoff_bytes_median")
    for i, (label, g) in enumerate(moved.groupby("topology_label", sort=False)):
        mb = g["handoff_bytes_median"] / 1e6
        _errorbar(ax_h, mb, g["handoff_ms_median"], g["handoff_ms_min"], g["handoff_ms_max"], color=color(label, i + 1),
                  label=label)
        for x, y, gib in zip(mb, g["handoff_ms_median"], g["handoff_gib_s_median"]):
            ax_h.annotate(f"{gib:.2f} GiB/s", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    _mb_axis(ax_h, "handoff size (MB, log scale)")
    ax_h.set_ylabel("handoff stream time (ms)")
    ax_h.set_title("handoff time vs size (labels: GiB/s at the median)")
    if ax_h.lines:
        ax_h.legend(fontsize=8)
    fig.suptitle(title, fontsize=11)
    return _render(fig, title, f"Disaggregated TTFT against prompt length and KV handoff time against size: {title}")


def handoff_frames_plot(df: pd.DataFrame, title: str) -> Plot:
    """One handoff's GiB/s against its size per suite and dtype, and the protected/unprotected ratio,
    from ``disagg.frames_summary``."""
    fig = Figure(figsize=(12, 3.9), layout="constrained")
    ax_bw, ax_ov = fig.subplots(1, 2)
    for i, ((suite, dtype), g) in enumerate(df.sort_values("tensor_bytes").groupby(["suite", "dtype"], sort=False)):
        label = f"{SUITE_LABELS.get(suite, 'AES-256-GCM' if suite == 'aes' else suite)}, {dtype}"
        c = color("aes_256_gcm" if suite == "aes" else suite, i)
        style = "-" if dtype == "float32" else "--"
        ax_bw.plot(g["tensor_bytes"] / 1e6, g["gib_s"], marker="o", linestyle=style, color=c, label=label)
        if suite != "unprotected":
            ax_ov.plot(g["tensor_bytes"] / 1e6, g["vs_unprotected"], marker="o", linestyle=style, color=c, label=label)
    for ax in (ax_bw, ax_ov):
        _mb_axis(ax, "KV tensor bytes per handoff (MB, log scale)")
    ax_bw.set_ylabel("handoff throughput at p50 (GiB/s)")
    ax_bw.set_title("handoff GiB/s, protected and unprotected")
    ax_bw.legend(fontsize=8)
    _overhead_axis(ax_ov, "protected p50 / unprotected p50 (x)")
    fig.suptitle(title, fontsize=11)
    return _render(fig, title, f"KV handoff throughput and protection overhead against size: {title}")


def agent_plot(df: pd.DataFrame, title: str) -> Plot:
    """TTFT against turn per variant (median over conversations and repeats, min-max bars, log scale) and the
    share of the previous turns' tokens the prefix cache gave back, from ``agent.turn_summary``."""
    fig = Figure(figsize=(12, 3.9), layout="constrained")
    ax_t, ax_r = fig.subplots(1, 2)
    for i, (variant, g) in enumerate(df.sort_values("turn").groupby("variant", sort=False)):
        _errorbar(ax_t, g["turn"], g["ttft_ms_median"] / 1000, g["ttft_ms_min"] / 1000, g["ttft_ms_max"] / 1000,
                  color=color(variant, i), label=variant)
        later = g[g["turn"] >= 2]
        ax_r.plot(later["turn"], later["reuse"] * 100, marker="o", color=color(variant, i), label=variant)
    ax_t.set_yscale("log")
    ax_t.set_ylabel("time to first token (s, log scale)")
    ax_t.set_title("TTFT per turn (median; bars: min-max)")
    ax_r.set_ylabel("prefix tokens reused (% of the previous turn's)")
    ax_r.set_ylim(0, 105)
    ax_r.set_title("prefix reuse per turn")
    for ax in (ax_t, ax_r):
        ax.set_xlabel("turn")
        ax.xaxis.set_major_locator(FixedLocator(sorted(set(df["turn"]))))
        ax.grid(True, alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=11)
    return _render(fig, title, f"Agent conversations: TTFT and prefix reuse per turn by variant: {title}")
