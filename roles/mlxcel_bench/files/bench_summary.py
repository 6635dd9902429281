"""Text summaries of one bench.yml run for the play's output: per benchmark, one complete table with
its header, from the rows fetched to the controller (read and validated as ``mlxcel report`` reads them).

    python bench_summary.py RESULTS_DIR

- frame: every suite and payload, with p50 relative to unprotected at the same payload;
- pipeline: tok/s per topology; a ratio against the baseline mode only where mlxcel.report.tables
  says it is fair (rows marked fair_comparison), else a line saying why there is none;
- serving: one line per round and concurrency level, labelled "round i/N".
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path
from typing import Callable

import pandas as pd

from mlxcel.report import html, tables
from mlxcel.report.load import ReportInputError, load

# header, cell of a row, left-aligned
Column = tuple[str, Callable[[pd.Series], str], bool]


def text_table(df: pd.DataFrame, columns: list[Column]) -> list[str]:
    """A header line, a rule, and one line per row; text columns left-aligned, numbers right-aligned."""
    cells = [[cell(r) for _, cell, _ in columns] for _, r in df.iterrows()]
    widths = [max([len(h)] + [len(row[i]) for row in cells]) for i, (h, _, _) in enumerate(columns)]

    def line(values: list[str]) -> str:
        return "  ".join(v.ljust(w) if left else v.rjust(w)
                         for v, w, (_, _, left) in zip(values, widths, columns)).rstrip()

    return [line([h for h, _, _ in columns]), line(["-" * w for w in widths]), *map(line, cells)]


def _col(header: str, field: str, fmt: Callable[[object], str], left: bool = False) -> Column:
    return header, lambda r: fmt(r[field]), left


def frame_lines(df: pd.DataFrame) -> list[str]:
    summary = tables.frame_summary(df)
    order = {"unprotected": 0, "hmac_sha256": 1, "aes_256_gcm": 2, "chacha20_poly1305": 3}
    summary = summary.assign(_o=summary["suite"].map(order)).sort_values(["session", "link", "_o", "payload_bytes"])
    columns = [
        _col("link", "link", html.text, True), _col("suite", "mode", html.text, True),
        _col("payload", "payload_bytes", html.size), _col("iterations", "iterations", html.num(0)),
        _col("p50", "p50_us", html.micros), _col("p95", "p95_us", html.micros), _col("p99", "p99_us", html.micros),
        _col("one-way GiB/s", "one_way_gib_s", html.num(2)),
        _col("p50 vs unprotected", "overhead_vs_unprotected", html.ratio),
    ]
    return _sections("frame (bench/frame_bench.py): one-way latency, half an echo round trip", summary, columns)


def pipeline_lines(df: pd.DataFrame) -> list[str]:
    summary = tables.pipeline_summary(df).sort_values(["session", "streams", "stages", "mode"])
    columns = [
        _col("mode", "mode", html.text, True), _col("stages", "stages", html.num(0)),
        _col("streams", "streams", html.num(0)), _col("return", "return", html.text, True),
        _col("runs", "tok_s_n", html.num(0)), _col("tok/s median", "tok_s_median", html.num(2)),
        ("tok/s range", lambda r: html.spread(2)(r["tok_s_min"], r["tok_s_max"]), False),
        _col("ms/token p50", "per_token_ms_p50_median", html.num(2)),
        _col("frames/token", "frames_per_token_median", html.num(2)),
        _col("bytes/token", "bytes_per_token_median", html.num(0)),
        _col("identical", "all_identical", html.text, True),
    ]
    if summary["vs_baseline"].notna().any():  # a ratio only where the rows say the comparison is fair
        columns.append(("vs baseline", _ratio_cell, False))
    out = _sections("pipeline (bench/pipeline_bench.py): decode tok/s per topology", summary, columns)
    if tables.unfair_single(summary):
        out += textwrap.wrap(tables.UNFAIR_SINGLE_NOTE, 110)
    return out


def _ratio_cell(r: pd.Series) -> str:
    """e.g. "0.91x single"; "–" where there is no fair ratio."""
    return html.ratio(r["vs_baseline"]) + ("" if pd.isna(r["vs_baseline"]) else f" {r['baseline']}")


def serving_lines(df: pd.DataFrame) -> list[str]:
    rounds = df.groupby([df["session"], df["run"].fillna("")])["round"].transform("max") + 1
    df = df.assign(_rounds=rounds, _order=df["order"].fillna(0))
    df = df.sort_values(["session", "round", "concurrency", "_order"])
    ms = html.num(1)
    columns = [
        ("round", lambda r: f"round {int(r['round']) + 1}/{int(r['_rounds'])}", True),
        _col("server", "server", html.text, True), _col("clients", "concurrency", html.num(0)),
        _col("requests", "requests", html.num(0)), _col("errors", "errors", html.num(0)),
        ("TTFT p50/p95 ms", lambda r: f"{ms(r['ttft_p50_ms'])}/{ms(r['ttft_p95_ms'])}", False),
        ("ITL p50/p95 ms", lambda r: f"{ms(r['itl_p50_ms'])}/{ms(r['itl_p95_ms'])}", False),
        _col("per-request tok/s", "req_tps_mean", html.num(2)), _col("aggregate tok/s", "agg_tps", html.num(2)),
    ]
    out = _sections("serving (bench/serve_bench.py): streaming clients, one line per round and level", df, columns)
    errors = df[df["errors"] > 0]
    if len(errors):
        out.append(f"first error: {errors['error_sample'].iloc[0]}")
    return out


def _sections(title: str, df: pd.DataFrame, columns: list[Column]) -> list[str]:
    """The title, then a table per session (machine and date) under its name."""
    out = [title]
    for session, g in df.groupby("session", sort=False):
        out += [f"  {session}", *("  " + line for line in text_table(g, columns))]
    return out


RENDERERS = {"frame": frame_lines, "pipeline": pipeline_lines, "serve": serving_lines}


def summary(results: Path) -> str:
    """Every benchmark's table found under ``results``, separated by blank lines."""
    loaded = load([results])
    parts = ["\n".join(render(loaded.table(name))) for name, render in RENDERERS.items()
             if not loaded.table(name).empty]
    if loaded.problems:
        parts.append(f"{len(loaded.problems)} invalid rows left out (listed in the report)")
    return "\n\n".join(parts) or "no benchmark rows"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: bench_summary.py RESULTS_DIR", file=sys.stderr)
        return 2
    try:
        print(summary(Path(args[0])))
    except ReportInputError as exc:
        print(f"bench_summary: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
