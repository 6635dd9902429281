"""Build a report directory: tidy CSVs, one self-contained index.html, and a report.json marker."""

from __future__ import annotations

import datetime as _dt
import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import pandas as pd

from mlxcel import __version__
from mlxcel.report import baseline as _baseline
from mlxcel.report import agent, disagg, html, kv_quality, plots, protection, reference, scaling, structured, tables
from mlxcel.report.load import REPORT_MARKER, Loaded, ReportInputError, load


class ReportError(Exception):
    """The report cannot be built as asked (one line, or a list of input problems)."""

    def __init__(self, message: str, problems: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.problems = list(problems)


@dataclass
class ReportResult:
    out_dir: Path
    index: Path
    csv_files: list[str]
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    regressions: int = 0
    rows: int = 0


def summarize(loaded: Loaded) -> dict[str, pd.DataFrame]:
    """Every summary table of the report, by name."""
    return {
        "decode": tables.decode_summary(loaded.table("decode")),
        "decode_comparison": tables.decode_comparison(loaded.table("decode")),
        "frame": tables.frame_summary(loaded.table("frame")),
        "pipeline": tables.pipeline_summary(loaded.table("pipeline")),
        "serve": tables.serve_summary(loaded.table("serve")),
        "tp": tables.tp_summary(loaded.table("tp")),
        "disagg_frames": disagg.frames_summary(loaded.table("disagg_frames")),
        "disagg_handoff": disagg.handoff_summary(loaded.table("disagg_handoff")),
        "disagg_serve": disagg.serve_summary(loaded.table("disagg_serve")),
        "protection": protection.protection_summary(loaded.table("pipeline_protection_summary")),
        "structured": structured.structured_summary(loaded.table("structured_output_summary")),
        "kv_quality": kv_quality.quality_summary(loaded.table("kv_bits_quality_summary")),
        "agent_turns": agent.turn_summary(loaded.table("agent_turns")),
        "agent_summary": agent.variant_summary(loaded.table("agent_summary"), loaded.table("agent_ratio")),
        "environment": tables.environment_table(loaded.tables),
        **scaling.summaries(loaded.tables),
    }


def _baseline_metrics(path: Path) -> pd.DataFrame:
    """A previous report's metrics.csv, or the metrics of a previous run's raw results."""
    if (path / REPORT_MARKER).is_file() and (path / "metrics.csv").is_file():
        return pd.read_csv(path / "metrics.csv")
    try:
        loaded = load([path])
    except ReportInputError as exc:
        raise ReportError(f"baseline: {exc}") from None
    if loaded.problems:
        raise ReportError(f"baseline {path}: {len(loaded.problems)} invalid rows", loaded.problems)
    return tables.metrics(summarize(loaded))


def _write_csvs(out: Path, frames: dict[str, pd.DataFrame]) -> list[str]:
    written = []
    for name, df in frames.items():
        if df is None or df.empty:
            continue
        df.to_csv(out / f"{name}.csv", index=False)
        written.append(f"{name}.csv")
    return written


# -- sections -------------------------------------------------------------------------------------

def _frame_sections(df: pd.DataFrame) -> list[dict[str, Any]]:
    cols: list[html.Column] = [
        ("mode", "mode", html.text), ("payload", "payload_bytes", html.size), ("iterations", "iterations", html.num(0)),
        ("p50", "p50_us", html.micros), ("p95", "p95_us", html.micros), ("p99", "p99_us", html.micros),
        ("one-way bandwidth (GiB/s)", "one_way_gib_s", html.num(2)),
        ("overhead vs unprotected", "overhead_vs_unprotected", html.ratio),
        ("reference p50 (other hw)", "reference_p50_us", html.micros),
        ("reference GiB/s (other hw)", "reference_gib_s", html.num(2)),
    ]
    out = []
    for (session, machine, link), g in df.groupby(["session", "machine", "link"], sort=False):
        g = g.sort_values(["suite", "payload_bytes"], key=lambda s: s.map(_SUITE_ORDER) if s.name == "suite" else s)
        title = f"{machine}, {link}{' (quick)' if g['quick'].any() else ''} — {session}"
        out.append({"title": title, "plot": plots.frame_plot(g, title),
                    "table": html.table(g, cols, lambda r: "chosen" if r["suite"] == "aes_256_gcm" else "")})
    return out


_SUITE_ORDER = {"unprotected": 0, "hmac_sha256": 1, "aes_256_gcm": 2, "chacha20_poly1305": 3}


def _pipeline_sections(df: pd.DataFrame) -> list[dict[str, Any]]:
    cols: list[html.Column] = [
        ("mode", "mode", html.text), ("stages", "stages", html.num(0)), ("streams", "streams", html.num(0)),
        ("return", "return", html.text), ("runs", "tok_s_n", html.num(0)), ("tok/s (median)", "tok_s_median", html.num(1)),
        ("tok/s range", ("tok_s_min", "tok_s_max"), html.spread(1)),
        ("per-token p50 (ms)", "per_token_ms_p50_median", html.num(2)),
        ("frames/token", "frames_per_token_median", html.num(1)), ("bytes/token", "bytes_per_token_median", html.kib),
        ("identical", "all_identical", html.text), ("ABBA positions", "order_positions", html.text),
    ]
    ratio: html.Column = ("vs baseline (fair runs only)", "vs_baseline", html.ratio)
    per_run: list[html.Column] = [  # shown where the rows record them (fresh-process workers)
        ("per-token p95 (ms)", "per_token_ms_p95_median", html.num(2)),
        ("latency p50 (ms)", "latency_ms_p50_median", html.num(2)), ("latency p95 (ms)", "latency_ms_p95_median", html.num(2)),
        ("CPU-s worker", "cpu_s_worker_median", html.num(2)), ("CPU-s stages", "cpu_s_stages_median", html.num(2)),
        ("CPU-s per stage", "cpu_s_per_stage", html.text),
    ]
    out = []
    for (session, machine, model), g in df.groupby(["session", "machine", "model"], sort=False):
        g = g.sort_values(["stages", "mode", "streams"])
        title = f"{model} on {machine} — {session}"
        shown = cols + [ratio] if g["vs_baseline"].notna().any() else cols  # a ratio only where it is fair
        shown = shown + [c for c in per_run if g[c[1]].map(lambda v: pd.notna(v) and v != "").any()]
        note = tables.UNFAIR_SINGLE_NOTE if tables.unfair_single(g) else ""
        out.append({"title": title, "plot": plots.pipeline_plot(g, title), "table": html.table(g, shown), "note": note})
    return out


def _serve_sections(df: pd.DataFrame) -> list[dict[str, Any]]:
    cols: list[html.Column] = [
        ("server", "server", html.text), ("clients", "concurrency", html.num(0)), ("rounds", "rounds", html.num(0)),
        ("went first", "went_first", html.num(0)), ("same prompts", "same_prompts", html.text),
        ("TTFT p50 (ms)", "ttft_p50_ms_median", html.num(1)), ("TTFT p50 range", ("ttft_p50_ms_min", "ttft_p50_ms_max"), html.spread(1)),
        ("TTFT p95 (ms)", "ttft_p95_ms_median", html.num(1)),
        ("ITL p50 (ms)", "itl_p50_ms_median", html.num(1)), ("ITL p50 range", ("itl_p50_ms_min", "itl_p50_ms_max"), html.spread(1)),
        ("ITL p95 (ms)", "itl_p95_ms_median", html.num(1)),
        ("aggregate tok/s", "agg_tps_median", html.num(2)), ("aggregate range", ("agg_tps_min", "agg_tps_max"), html.spread(2)),
        ("requests", "requests", html.num(0)), ("errors", "errors", html.num(0)),
    ]
    out = []
    for (session, machine, arrival, max_tokens), g in df.groupby(["session", "machine", "arrival", "max_tokens"], sort=False):
        g = g.sort_values(["concurrency", "server"])
        title = f"{machine}, {arrival} arrivals, max_tokens {max_tokens} — {session}"
        out.append({"title": title, "plot": plots.serve_plot(g, title),
                    "table": html.table(g, cols, lambda r: "regression" if r["errors"] else "")})
    return out


_LOAD: html.Column = ("load (1 min)", ("load_1m_min", "load_1m_max"), html.spread(1))


def _disagg_sections(summaries: dict[str, pd.DataFrame]) -> list[dict[str, Any]]:
    """The handoff per request, its frames protected and unprotected, and serving against the single node."""
    parts = ((_handoff_sections, "disagg_handoff"), (_handoff_frame_sections, "disagg_frames"),
             (_disagg_serve_sections, "disagg_serve"))
    return [s for sections, name in parts if not summaries[name].empty for s in sections(summaries[name])]


def _handoff_sections(df: pd.DataFrame) -> list[dict[str, Any]]:
    cols: list[html.Column] = [
        ("prompt tokens (asked)", "target_prompt_tokens", html.num(0)), ("prompt tokens", "prompt_tokens", html.num(0)),
        ("topology", "topology_label", html.text), ("repeats", "repeats", html.num(0)),
        ("TTFT (ms)", "ttft_ms_median", html.num(1)), ("TTFT range", ("ttft_ms_min", "ttft_ms_max"), html.spread(1)),
        ("TTFT vs single node", "ttft_vs_single_median", html.ratio),
        ("ratio range", ("ttft_vs_single_min", "ttft_vs_single_max"), _ratio_range),
        ("end to end (ms)", "e2e_ms_median", html.num(1)), ("prefill (ms)", "prefill_ms_median", html.num(1)),
        ("handoff bytes", "handoff_bytes_median", html.mbytes), ("handoff stream (ms)", "handoff_ms_median", html.num(2)),
        ("stream range", ("handoff_ms_min", "handoff_ms_max"), html.spread(2)),
        ("handoff GiB/s", "handoff_gib_s_median", html.num(2)),
        ("GiB/s range", ("handoff_gib_s_min", "handoff_gib_s_max"), html.spread(2)), _LOAD,
    ]
    out = []
    for (session, machine), g in df.groupby(["session", "machine"], sort=False):
        title = f"KV handoff per request, {machine} — {session}"
        out.append({"title": title, "plot": plots.handoff_plot(g, title), "table": html.table(g, cols)})
    return out


def _handoff_frame_sections(df: pd.DataFrame) -> list[dict[str, Any]]:
    cols: list[html.Column] = [
        ("KV dtype", "dtype", html.text), ("prompt tokens", "prompt_tokens", html.num(0)), ("suite", "suite", html.text),
        ("protected", "protected", html.text), ("tensor bytes", "tensor_bytes", html.mbytes),
        ("repeats", "repeats", html.num(0)), ("p50 (ms)", "p50_ms", html.num(2)), ("p95 (ms)", "p95_ms", html.num(2)),
        ("GiB/s at p50", "gib_s", html.num(2)), ("vs unprotected", "vs_unprotected", html.ratio),
        ("load (1 min)", "load_1m", html.num(1)),
    ]
    out = []
    for (session, machine), g in df.groupby(["session", "machine"], sort=False):
        title = f"One handoff, protected and unprotected, {machine} — {session}"
        out.append({"title": title, "plot": plots.handoff_frames_plot(g, title),
                    "table": html.table(g, cols, lambda r: "chosen" if r["protected"] else "")})
    return out


def _disagg_serve_sections(df: pd.DataFrame) -> list[dict[str, Any]]:
    cols: list[html.Column] = [
        ("topology", "server", html.text), ("clients", "concurrency", html.num(0)), ("rounds", "rounds", html.num(0)),
        ("same prompts", "same_prompts", html.text),
        ("TTFT p50 (ms)", "ttft_p50_ms_median", html.num(1)),
        ("TTFT p50 range", ("ttft_p50_ms_min", "ttft_p50_ms_max"), html.spread(1)),
        ("TTFT p95 (ms)", "ttft_p95_ms_median", html.num(1)),
        ("ITL p50 (ms)", "itl_p50_ms_median", html.num(1)),
        ("ITL p50 range", ("itl_p50_ms_min", "itl_p50_ms_max"), html.spread(1)),
        ("ITL p95 (ms)", "itl_p95_ms_median", html.num(1)),
        ("aggregate tok/s", "agg_tps_median", html.num(2)), ("aggregate range", ("agg_tps_min", "agg_tps_max"), html.spread(2)),
        ("tok/s vs single node", "tps_vs_single_median", html.ratio),
        ("tok/s ratio range", ("tps_vs_single_min", "tps_vs_single_max"), _ratio_range),
        ("TTFT p50 vs single node", "ttft_vs_single_median", html.ratio),
        ("TTFT ratio range", ("ttft_vs_single_min", "ttft_vs_single_max"), _ratio_range),
        ("ITL p50 vs single node", "itl_vs_single_median", html.ratio),
        ("handoff per request", "handoff_bytes_mean_median", html.mbytes),
        ("handoff ms per request", "handoff_ms_mean_median", html.num(2)),
        ("requests", "requests", html.num(0)), ("errors", "errors", html.num(0)), _LOAD,
    ]
    out = []
    for (session, machine, prompt, max_tokens), g in df.groupby(["session", "machine", "prompt", "max_tokens"], sort=False):
        about = f" of about {int(g['long_tokens'].max())} tokens" if prompt == "long" and g["long_tokens"].notna().any() else ""
        title = f"{machine}, {prompt} prompts{about}, max_tokens {max_tokens} — {session}"
        out.append({"title": title, "plot": plots.serve_plot(g, title),
                    "table": html.table(g, cols, lambda r: "regression" if r["errors"] else "")})
    return out


def _agent_sections(turns: pd.DataFrame, summary: pd.DataFrame) -> list[dict[str, Any]]:
    """Per session, machine and conversation count: TTFT per turn (plot and table) and the variants' summary."""
    out = []
    if turns.empty:
        return out
    for (session, machine, n), g in turns.groupby(["session", "machine", "conversations"], sort=False):
        s = summary[(summary["session"] == session) & (summary["machine"] == machine)
                    & (summary["conversations"] == n)] if not summary.empty else summary
        title = f"{n} conversations at once, {machine} — {session}"
        out.append({"title": title, "plot": plots.agent_plot(g, title), "table": agent.turn_table(g),
                    "summary": agent.summary_table(s) if not s.empty else None})
    return out


def _tp_table(df: pd.DataFrame) -> html.Table:
    """tp 1 against tp N (or two tp N configurations) per model, path and batch; B / A only where fair."""
    return html.table(df, [
        ("session", "session", html.text), ("machine", "machine", html.text), ("model", "model_name", html.text),
        ("shape", "shape", html.text), ("path", "impl", html.text), ("batch", "batch", html.num(0)),
        ("A", "a", html.text), ("A tok/s (median)", "a_tok_s_median", html.num(1)),
        ("A range", ("a_tok_s_min", "a_tok_s_max"), html.spread(1)),
        ("B", "b", html.text), ("B tok/s (median)", "b_tok_s_median", html.num(1)),
        ("B range", ("b_tok_s_min", "b_tok_s_max"), html.spread(1)), ("rounds", "rounds", html.num(0)),
        ("B / A (fair runs only)", "ratio_median", html.ratio), ("B / A range", ("ratio_min", "ratio_max"), _ratio_range),
        ("greedy tokens", "tokens", html.text),
    ])


def _ratio_range(lo: Any, hi: Any) -> str:
    return "–" if pd.isna(lo) else f"{html.ratio(lo)} – {html.ratio(hi)}"


def _decode_table(cmp: pd.DataFrame) -> html.Table:
    cmp = cmp.assign(**{f"{impl}_kv_mib": pd.to_numeric(cmp[f"{impl}_kv_cache_bytes_median"]) / 2**20
                        for impl in ("mlxcel", "mlx_lm")})
    return html.table(cmp, [
        ("session", "session", html.text), ("machine", "machine", html.text), ("model", "model", html.text),
        ("weights", "weights", html.text), ("KV cache", "kv", html.text), ("context", "context", html.num(0)),
        ("runs", "runs", html.num(0)),
        ("mlxcel decode tok/s", "mlxcel_decode_tps_median", html.num(2)),
        ("mlxcel range", ("mlxcel_decode_tps_min", "mlxcel_decode_tps_max"), html.spread(2)),
        ("mlx-lm decode tok/s", "mlx_lm_decode_tps_median", html.num(2)),
        ("mlx-lm range", ("mlx_lm_decode_tps_min", "mlx_lm_decode_tps_max"), html.spread(2)),
        ("ratio (medians)", "decode_ratio", html.num(3)), ("median per-run ratio", "median_run_ratio", html.num(3)),
        ("prompt ratio", "prompt_ratio", html.num(3)),
        ("mlxcel KV MiB", "mlxcel_kv_mib", html.num(2)), ("mlx-lm KV MiB", "mlx_lm_kv_mib", html.num(2)),
    ])


_ENV_FIELDS = {
    "cpu": "CPU", "cpu_count": "CPU count", "memory_gb": "memory (GiB)", "accelerator": "MLX device name",
    "mlx_device": "MLX device", "arch": "architecture", "platform": "platform", "python": "Python", "mlx": "MLX",
    "mlx_lm": "mlx-lm", "mlxcel": "mlxcel", "git_commits": "git commits", "rows_without_commit": "rows without commit",
    "first_run": "first run", "last_run": "last run", "benches": "benchmarks", "sessions": "sessions", "rows": "rows",
}


def _env_table(env: pd.DataFrame) -> html.Table | None:
    """Transposed: one column per machine, one row per attribute (machines are few, attributes many)."""
    if env.empty:
        return None
    rows = [[label, *(html.text(v) or "–" for v in env[col])] for col, label in _ENV_FIELDS.items() if col in env]
    return html.Table(["machine", *env["machine"]], rows, [""] * len(rows), [False] * (len(env) + 1))


def _comparison_table(cmp: pd.DataFrame) -> html.Table:
    return html.table(cmp, [
        ("status", "status", html.text), ("bench", "bench", html.text), ("configuration", "key", html.text),
        ("metric", "metric", html.text), ("unit", "unit", html.text), ("better", "better", html.text),
        ("baseline", "baseline_median", html.num(2)), ("baseline range", ("baseline_min", "baseline_max"), html.spread(2)),
        ("current", "current_median", html.num(2)), ("current range", ("current_min", "current_max"), html.spread(2)),
        ("change", "change", html.pct), ("judged by", "basis", html.text),
    ], lambda r: r["status"] if r["status"] in ("regression", "improvement") else "")


@functools.lru_cache(maxsize=1)
def _reference_context() -> dict[str, Any]:
    """The reference section; the same for every report, so drawn once per process."""
    ref_frame = reference.frame_table()
    ref_pipe = reference.pipeline_table()
    return {
        "ref_hardware": reference.HARDWARE, "ref_source": reference.SOURCE, "ref_pipeline_model": reference.PIPELINE_MODEL,
        "ref_pipeline_plot": plots.reference_pipeline_plot(ref_pipe, "Reference two-stage pipeline decode "
                                                                      "(other hardware: NVIDIA GB10)"),
        "ref_pipeline_table": html.table(ref_pipe, [
            ("variant", "variant", html.text), ("runs", "runs", html.num(0)), ("tok/s (median)", "tok_s_median", html.num(1)),
            ("range", ("tok_s_min", "tok_s_max"), html.spread(1))]),
        "ref_frame_plot": plots.frame_plot(ref_frame, "Reference frame protection (other hardware: " + reference.HARDWARE + ")"),
        "ref_frame_table": html.table(ref_frame, [
            ("mode", "mode", html.text), ("payload", "payload_bytes", html.size), ("iterations", "iterations", html.num(0)),
            ("p50", "p50_us", html.micros), ("p95", "p95_us", html.micros), ("p99", "p99_us", html.micros),
            ("one-way bandwidth (GiB/s)", "one_way_gib_s", html.num(2)),
            ("overhead vs unprotected", "overhead_vs_unprotected", html.ratio)],
            lambda r: "chosen" if r["suite"] == "aes_256_gcm" else ""),
    }


# -- entry point ----------------------------------------------------------------------------------

def build_report(inputs: Sequence[str | Path], out_dir: str | Path, *, baseline: str | Path | None = None,
                 tolerance: float = _baseline.DEFAULT_TOLERANCE, keep_going: bool = False,
                 title: str = "mlxcel benchmark report") -> ReportResult:
    """Read, validate and summarize ``inputs``; write CSVs, index.html and report.json into ``out_dir``.

    Invalid rows raise ReportError listing every problem, unless ``keep_going``: then the report is
    written with the rejected rows listed at its top (and in rejected.csv), and the result carries them.
    """
    out = Path(out_dir)
    try:
        loaded = load(inputs, exclude=out)
    except ReportInputError as exc:
        raise ReportError(str(exc)) from None
    if loaded.problems and not keep_going:
        raise ReportError(f"{len(loaded.problems)} invalid rows or files; nothing written", loaded.problems)
    if not loaded.tables:
        raise ReportError("no valid benchmark rows in the inputs", loaded.problems)
    summaries = summarize(loaded)
    metrics = tables.metrics(summaries)
    comparison = None
    if baseline is not None:
        if not Path(baseline).is_dir():
            raise ReportError(f"baseline: no such directory: {baseline}")
        comparison = _baseline.compare(metrics, _baseline_metrics(Path(baseline)), tolerance)
    regressions = 0 if comparison is None else int((comparison["status"] == "regression").sum())

    out.mkdir(parents=True, exist_ok=True)
    csvs = _write_csvs(out, {
        **{f"rows_{name}": df for name, df in loaded.tables.items()},
        "environment": summaries["environment"], "decode_summary": summaries["decode"],
        "decode_comparison": summaries["decode_comparison"], "frame_summary": summaries["frame"],
        "pipeline_summary": summaries["pipeline"], "serve_summary": summaries["serve"], "tp_summary": summaries["tp"],
        "disagg_frames_summary": summaries["disagg_frames"], "disagg_handoff_summary": summaries["disagg_handoff"],
        "disagg_serve_summary": summaries["disagg_serve"], "protection_summary": summaries["protection"],
        "structured_output_summary": summaries["structured"], "agent_turn_summary": summaries["agent_turns"],
        "agent_variant_summary": summaries["agent_summary"], "kv_bits_quality_summary": summaries["kv_quality"],
        "metrics": metrics,
        **{name: summaries[name] for name in scaling.summaries({})},
        "reference_frame": reference.frame_table(), "reference_pipeline": reference.pipeline_table(),
        "baseline_comparison": comparison,
        "rejected": pd.DataFrame({"problem": loaded.problems}) if loaded.problems else None,
    })
    cmp = summaries["decode_comparison"]
    context = {
        "title": title, "version": __version__, "generated": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "files": loaded.files, "row_count": sum(len(df) for df in loaded.tables.values()),
        "files_table": html.table(pd.DataFrame(loaded.files), [
            ("file", "file", html.text), ("benchmarks", "benches", html.text), ("rows", "rows", html.num(0)),
            ("rejected", "rejected", html.num(0))], lambda r: "regression" if r["rejected"] else ""),
        "problems": loaded.problems, "notes": loaded.notes, "warnings": tables.commit_warnings(loaded.tables),
        "csv_files": csvs, "env_table": _env_table(summaries["environment"]),
        "decode_table": _decode_table(cmp) if not cmp.empty else None,
        "decode_plot": plots.decode_plot(cmp) if not cmp.empty else None,
        "frame_sections": _frame_sections(summaries["frame"]) if not summaries["frame"].empty else [],
        "pipeline_sections": _pipeline_sections(summaries["pipeline"]) if not summaries["pipeline"].empty else [],
        "serve_sections": _serve_sections(summaries["serve"]) if not summaries["serve"].empty else [],
        "disagg_sections": _disagg_sections(summaries),
        "scaling": scaling.section({name: summaries[name] for name in scaling.summaries({})}),
        "tp_table": _tp_table(summaries["tp"]) if not summaries["tp"].empty else None, "tp_note": tables.TP_NOTE,
        "protection_table": (protection.protection_table(summaries["protection"])
                             if not summaries["protection"].empty else None),
        "structured_table": (structured.structured_table(summaries["structured"])
                             if not summaries["structured"].empty else None),
        "kv_quality_table": (kv_quality.quality_table(summaries["kv_quality"])
                             if not summaries["kv_quality"].empty else None),
        "agent_sections": _agent_sections(summaries["agent_turns"], summaries["agent_summary"]),
        "baseline": str(baseline) if baseline is not None else None,
        "comparison": _comparison_table(comparison) if comparison is not None else None,
        "regressions": regressions, "tolerance_pct": f"{tolerance:.0%}",
        **_reference_context(),
    }
    index = out / "index.html"
    index.write_text(html.render(context), encoding="utf-8")
    (out / REPORT_MARKER).write_text(json.dumps({
        "generator": "mlxcel report", "version": __version__, "generated": context["generated"],
        "inputs": [str(p) for p in inputs], "baseline": context["baseline"], "files": loaded.files,
        "rows": context["row_count"], "rejected": loaded.problems, "regressions": regressions, "csv": csvs,
    }, indent=2) + "\n")
    return ReportResult(out, index, csvs, loaded.problems, loaded.notes, regressions, context["row_count"])
