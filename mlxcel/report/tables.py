"""Tidy summary tables from the validated rows: one function per report section.

Spread is always the range (min to max) over the repeated measurements of one configuration
(runs, rounds); the headline value is their median.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pandas as pd

from mlxcel.report import reference

ENV_COLUMNS = {
    "env_host": "host", "env_cpu": "cpu", "env_cpu_count": "cpu_count", "env_machine_memory_gb": "memory_gb",
    "env_machine_arch": "arch", "env_platform": "platform", "env_python": "python", "env_mlx_device": "mlx_device",
    "env_machine_accelerator": "accelerator", "env_versions_mlx": "mlx", "env_versions_mlx-lm": "mlx_lm",
    "env_versions_mlxcel": "mlxcel",
}
_COMMIT = re.compile(r"^[0-9a-f]{7,40}(-dirty)?$")


def spread(df: pd.DataFrame, keys: list[str], value: str, prefix: str | None = None) -> pd.DataFrame:
    """median/min/max/n of ``value`` per ``keys`` group (NaN values ignored)."""
    p = prefix or value
    g = df.groupby(keys, dropna=False, sort=False)[value]
    return g.agg(**{f"{p}_median": "median", f"{p}_min": "min", f"{p}_max": "max", f"{p}_n": "count"}).reset_index()


def spreads(df: pd.DataFrame, keys: list[str], values: tuple[str, ...]) -> pd.DataFrame:
    """``spread`` of each of ``values`` per ``keys`` group, side by side."""
    out = spread(df, keys, values[0])
    for value in values[1:]:
        out = out.merge(spread(df, keys, value), on=keys, how="left")
    return out


def all_rows(tables: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """Every row of every table, with its bench, session, machine and environment columns only."""
    frames = []
    for df in tables.values():
        cols = [c for c in df.columns if c in ("bench", "session", "machine", "source_file") or c.startswith("env_")]
        frames.append(df[cols])
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def environment_table(tables: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """One row per machine: what it is, what ran there, from which commits and when."""
    rows = all_rows(tables)
    if rows.empty:
        return pd.DataFrame()
    out = []
    for machine, g in rows.groupby("machine", sort=True):
        rec: dict = {"machine": machine}
        for col, name in ENV_COLUMNS.items():
            vals = g[col].dropna().astype(str).unique() if col in g else []
            rec[name] = ", ".join(sorted(vals)) if len(vals) else ""
        commits = g["env_git_commit"].fillna("").astype(str) if "env_git_commit" in g else pd.Series([""] * len(g))
        rec["git_commits"] = ", ".join(sorted({c[:12] + ("-dirty" if c.endswith("-dirty") else "")
                                              for c in commits if _COMMIT.match(c)})) or "unknown"
        rec["rows_without_commit"] = int(sum(not _COMMIT.match(c) for c in commits))
        dates = g["env_date"].dropna().astype(str) if "env_date" in g else pd.Series(dtype=str)
        rec["first_run"] = dates.min() if len(dates) else ""
        rec["last_run"] = dates.max() if len(dates) else ""
        rec["benches"] = ", ".join(sorted(g["bench"].unique()))
        rec["sessions"] = g["session"].nunique()
        rec["rows"] = len(g)
        out.append(rec)
    return pd.DataFrame(out)


def commit_warnings(tables: dict[str, pd.DataFrame]) -> list[str]:
    """Rows whose environment has no real commit (old rows say "HEAD"), per file."""
    rows = all_rows(tables)
    if rows.empty or "env_date" not in rows:
        return []
    jsonl = rows[rows["env_date"].notna()]
    commits = (jsonl["env_git_commit"] if "env_git_commit" in jsonl else pd.Series(None, index=jsonl.index))
    bad = jsonl.assign(_c=commits.fillna("none").astype(str))
    bad = bad[~bad["_c"].str.match(_COMMIT.pattern)]
    return [f"{src}: {len(g)} rows record no git commit (recorded: {', '.join(sorted(map(repr, g['_c'].unique())))})"
            for src, g in bad.groupby("source_file")]


def _kv_label(bits: Any, group: Any) -> str:
    return "full" if pd.isna(bits) or not bits else f"{int(bits)}-bit g{int(group) if not pd.isna(group) else '?'}"


def _decode_rows(df: pd.DataFrame) -> pd.DataFrame:
    """decode rows with ``weights`` filled, ``kv`` (full, or "8-bit g64": --kv-bits, null in older rows) and
    ``context`` (the prompt's tokens), the keys a session's rows split by."""
    bits = df["kv_bits"] if "kv_bits" in df else pd.Series(None, index=df.index, dtype=float)
    group = df["kv_group_size"] if "kv_group_size" in df else pd.Series(None, index=df.index, dtype=float)
    return df.assign(weights=df["weights"].fillna("?"), kv=[_kv_label(b, g) for b, g in zip(bits, group)],
                     context=df["prompt_tokens"])


def decode_summary(df: pd.DataFrame) -> pd.DataFrame:
    """Per session, implementation, KV variant and context: decode tok/s median and range, prompt tok/s, latency,
    memory, KV cache bytes."""
    if df.empty:
        return pd.DataFrame()
    keys = ["session", "machine", "model", "weights", "impl", "kv", "context"]
    df = _decode_rows(df)
    out = spread(df, keys, "decode_tps")
    cols = ["prompt_tps", "token_latency_p50_ms", "token_latency_p95_ms", "peak_memory_gb", "kv_cache_bytes"]
    for col in (c for c in cols if c in df):
        out[f"{col}_median"] = df.groupby(keys, sort=False)[col].median().values
    return out


def decode_comparison(df: pd.DataFrame) -> pd.DataFrame:
    """Per session, KV variant and context: mlxcel against mlx-lm, ratio of medians and median of per-run ratios."""
    if df.empty:
        return pd.DataFrame()
    out = []
    keys = ["session", "machine", "model", "weights", "kv", "context"]
    for key, g in _decode_rows(df).groupby(keys, sort=False):
        ours, theirs = g[g["impl"] == "mlxcel"], g[g["impl"] == "mlx-lm"]
        rec = dict(zip(keys, key))
        rec["runs"] = min(len(ours), len(theirs))
        for name, part in (("mlxcel", ours), ("mlx_lm", theirs)):
            rec[f"{name}_decode_tps_median"] = part["decode_tps"].median()
            rec[f"{name}_decode_tps_min"] = part["decode_tps"].min()
            rec[f"{name}_decode_tps_max"] = part["decode_tps"].max()
            rec[f"{name}_prompt_tps_median"] = part["prompt_tps"].median()
            rec[f"{name}_kv_cache_bytes_median"] = part["kv_cache_bytes"].median() if "kv_cache_bytes" in g else None
        rec["decode_ratio"] = rec["mlxcel_decode_tps_median"] / rec["mlx_lm_decode_tps_median"]
        paired = ours.set_index("run")["decode_tps"] / theirs.set_index("run")["decode_tps"]
        rec["median_run_ratio"] = paired.dropna().median()
        rec["prompt_ratio"] = rec["mlxcel_prompt_tps_median"] / rec["mlx_lm_prompt_tps_median"]
        out.append(rec)
    return pd.DataFrame(out)


def frame_summary(df: pd.DataFrame) -> pd.DataFrame:
    """Every frame row with its link, p50 overhead against unprotected (same session and payload)
    and the reference's p50 for the same suite and payload (other hardware)."""
    if df.empty:
        return pd.DataFrame()
    out = df.copy()
    out["link"] = out["remote"].map(lambda r: f"remote {r}" if isinstance(r, str) and r else "loopback")
    base = out[out["suite"] == "unprotected"].set_index(["session", "payload_bytes"])["p50_us"]
    idx = pd.MultiIndex.from_frame(out[["session", "payload_bytes"]])
    out["overhead_vs_unprotected"] = out["p50_us"].values / base.reindex(idx).values
    ref = reference.frame_table().set_index(["suite", "payload_bytes"])
    ridx = pd.MultiIndex.from_frame(out[["suite", "payload_bytes"]])
    out["reference_p50_us"] = ref["p50_us"].reindex(ridx).values
    out["reference_gib_s"] = ref["one_way_gib_s"].reindex(ridx).values
    cols = ["session", "machine", "link", "mode", "suite", "payload_bytes", "iterations", "p50_us", "p95_us",
            "p99_us", "mean_us", "one_way_gib_s", "overhead_vs_unprotected", "reference_p50_us", "reference_gib_s",
            "quick"]
    return out[cols]


def pipeline_summary(df: pd.DataFrame) -> pd.DataFrame:
    """Per session and topology (mode, stages, streams, return): tok/s median and range, step
    latency, frames and bytes per token, whether every run matched the single-device output, and
    ``vs_baseline``, the tok/s ratio against the baseline mode where that comparison is fair."""
    if df.empty:
        return pd.DataFrame()
    keys = ["session", "machine", "model", "mode", "stages", "streams", "return"]
    out = spread(df, keys, "tok_s")
    g = df.groupby(keys, sort=False, dropna=False)
    out["per_token_ms_p50_median"] = g["per_token_ms_p50"].median().values
    for col in PIPELINE_RUN_MEDIANS:  # NaN for rows written before these fields existed
        out[f"{col}_median"] = pd.to_numeric(df[col], errors="coerce").groupby(
            [df[k] for k in keys], sort=False, dropna=False).median().values
    out["cpu_s_per_stage"] = (df["cpu_s_stage"] if "cpu_s_stage" in df else pd.Series(None, index=df.index)).groupby(
        [df[k] for k in keys], sort=False, dropna=False).agg(_per_stage_medians).values
    out["frames_per_token_median"] = g["frames_per_token"].median().values
    out["bytes_per_token_median"] = g["bytes_per_token"].median().values
    out["tokens"] = g["tokens"].max().values
    out["all_identical"] = g["identical"].all().values
    out["order_positions"] = g["order"].agg(lambda s: ",".join(map(str, sorted(s.unique())))).values
    fair = df[FAIR_FIELD] if FAIR_FIELD in df else pd.Series(False, index=df.index)
    out["fair_comparison"] = fair.eq(True).groupby([df[k] for k in keys], sort=False, dropna=False).all().values
    return _with_ratios(out)


PIPELINE_RUN_MEDIANS = ("per_token_ms_p95", "latency_ms_p50", "latency_ms_p95", "cpu_s_worker", "cpu_s_stages")


def _per_stage_medians(lists: pd.Series) -> str:
    """"0.41, 0.39": each stage process's median CPU-seconds over the runs ("" where none were recorded)."""
    runs = [list(x) for x in lists if isinstance(x, (list, tuple)) and x]
    if not runs:
        return ""
    return ", ".join(f"{pd.Series(col).median():.2f}" for col in zip(*runs))


# -- ratios between pipeline modes: only where fair ---------------------------------------------------

FAIR_FIELD = "fair_comparison"
UNFAIR_SINGLE_NOTE = (
    "No ratio against the single mode: it runs inside the benchmark process, at about half the speed of "
    "a fresh process (docs/benchmarks.md), so \"remote vs single\" would not be a fair comparison. Only rows "
    "marked fair_comparison (every mode in a fresh process, or the deployed single-node server as the "
    "baseline) get a ratio.")


def baseline_mode(mode: str) -> str:
    """The mode a pipeline mode is held against: the single-node server for server levels, else ``single``."""
    return "server_single" if str(mode).startswith("server_") else "single"


def _with_ratios(out: pd.DataFrame) -> pd.DataFrame:
    """``vs_baseline``: tok/s median over the baseline mode's (same session, machine, model and streams),
    only where the rows of both sides are marked fair; NaN everywhere else."""
    keys = ["session", "machine", "model", "streams"]
    base = (out[[*keys, "mode", "tok_s_median", "fair_comparison"]]
            .rename(columns={"mode": "baseline", "tok_s_median": "_base_tps", "fair_comparison": "_base_fair"})
            .drop_duplicates([*keys, "baseline"]))
    merged = out.assign(baseline=out["mode"].map(baseline_mode)).merge(base, on=[*keys, "baseline"], how="left")
    fair = merged["fair_comparison"] & merged["_base_fair"].eq(True) & (merged["mode"] != merged["baseline"])
    merged["vs_baseline"] = (merged["tok_s_median"] / merged["_base_tps"]).where(fair)
    return merged.drop(columns=["_base_tps", "_base_fair"])


def unfair_single(summary: pd.DataFrame) -> bool:
    """True where an unmarked in-process ``single`` row sits next to other modes at the same level:
    the comparison a reader would draw from them is the one docs/benchmarks.md calls unfair."""
    if summary.empty:
        return False
    keys = ["session", "machine", "model", "streams"]
    for _, g in summary.groupby(keys, sort=False, dropna=False):
        single = g[g["mode"] == "single"]
        if len(single) and len(g) > len(single) and not single["fair_comparison"].all():
            return True
    return False


def serve_summary(df: pd.DataFrame) -> pd.DataFrame:
    """Per session, server, arrival and concurrency: TTFT, ITL and throughput over the rounds,
    errors, and whether every server of the session got the same prompts at that level."""
    if df.empty:
        return pd.DataFrame()
    df = df.copy()
    df["arrival"] = df["arrival"].fillna("herd")
    keys = ["session", "machine", "server", "arrival", "max_tokens", "concurrency"]
    out = spreads(df, keys, ("ttft_p50_ms", "itl_p50_ms", "agg_tps"))
    g = df.groupby(keys, sort=False, dropna=False)
    extra = pd.DataFrame({
        "ttft_p95_ms_median": g["ttft_p95_ms"].median(), "itl_p95_ms_median": g["itl_p95_ms"].median(),
        "req_tps_mean_median": g["req_tps_mean"].median(), "requests": g["requests"].sum(),
        "errors": g["errors"].sum(), "rounds": g["round"].nunique(),
        "went_first": g["order"].agg(lambda s: int((s == 0).sum()) if s.notna().any() else None),
    }).reset_index()
    out = out.merge(extra, on=keys, how="left")
    out["same_prompts"] = out.apply(lambda r: same_prompts(df, r), axis=1)
    return out


def same_prompts(df: pd.DataFrame, row: pd.Series) -> str:
    """"yes" when every server of the session sent identical prompts at this level and round."""
    if "prompts_sha256" not in df:
        return "not recorded"
    level = df[(df["session"] == row["session"]) & (df["concurrency"] == row["concurrency"])
               & (df["arrival"] == row["arrival"])]
    if level["prompts_sha256"].isna().all():
        return "not recorded"
    per_round = level.groupby("round")["prompts_sha256"].nunique()
    return "yes" if (per_round == 1).all() else "no"


# -- tensor parallelism (bench/tp_bench.py) --------------------------------------------------------

_TP_LABELS = {"tp1": "tp 1", "model": "tp {n}", "bfloat16": "tp {n}, bfloat16 all-reduce",
              "float32": "tp {n}, float32 all-reduce", "one-reduce": "tp {n}, 1 all-reduce per layer (timing only)",
              "no-reduce": "tp {n}, no all-reduce (timing only)"}
TP_NOTE = ("Every measurement is a fresh process and the two configurations of a row alternate A B B A in each "
           "round, so B / A is the median of the per-round ratios, with their range. A ratio is shown only "
           "where every round ran both configurations in that order; mlxcel's and mlx-lm's rows are not held "
           "against each other (different drivers, not interleaved).")


def tp_variant(row: pd.Series) -> str:
    """A row's configuration; rows written before --variants compared tp 1 with tp N in the model's dtype."""
    v = row.get("variant")
    return v if isinstance(v, str) and v else ("tp1" if row["tp"] == 1 else "model")


def _tp_shape(shape: object) -> str:
    if not isinstance(shape, dict):
        return ""
    return (f"{shape.get('model_type', '?')}, {shape.get('num_hidden_layers', '?')} layers, hidden "
            f"{shape.get('hidden_size', '?')}, {shape.get('num_attention_heads', '?')}/"
            f"{shape.get('num_key_value_heads', '?')} heads/KV heads, intermediate {shape.get('intermediate_size', '?')}")


def _tp_pair(g: pd.DataFrame) -> dict:
    """A against B of one comparison: tok/s per side, per-round ratios, fairness, token agreement."""
    first = g.groupby("_v")["order"].min().sort_values()
    labels = list(first.index)
    rec: dict = {"configurations": len(labels)}
    for side, label in zip("ab", labels[:2]):
        tps = g.loc[g["_v"] == label, "decode_tok_s"]
        rec.update({side: _TP_LABELS.get(label, label).format(n=int(g["tp_compared"].iloc[0])), f"{side}_variant": label,
                    f"{side}_tok_s_median": tps.median(), f"{side}_tok_s_min": tps.min(), f"{side}_tok_s_max": tps.max(),
                    f"{side}_tok_s_n": int(tps.count())})
    ratios, fair = [], len(labels) == 2  # fair: both sides in every round, in A B B A positions
    for _, r in g.groupby("round") if fair else ():
        a, b = r[r["_v"] == labels[0]], r[r["_v"] == labels[1]]
        fair = fair and set(a["order"]) == {0, 3} and set(b["order"]) == {1, 2}
        ratios.append(b["decode_tok_s"].median() / a["decode_tok_s"].median() if len(a) and len(b) else float("nan"))
    rec["rounds"] = int(g["round"].nunique())
    rec["fair_comparison"] = bool(fair)
    shown = pd.Series(ratios if fair else [], dtype=float)
    rec.update(ratio_median=shown.median(), ratio_min=shown.min(), ratio_max=shown.max())
    digests = g["tokens_sha256"].dropna() if "tokens_sha256" in g else pd.Series(dtype=str)
    rec["tokens"] = ("not recorded" if len(digests) < len(g) else "same" if digests.nunique() == 1 else "differ")
    return rec


def tp_summary(df: pd.DataFrame) -> pd.DataFrame:
    """Per session, model, path, batch and comparison (tp 1 vs tp N, or two tp N variants): each side's
    decode tok/s (median, range), B / A with its range where fair, and whether the greedy tokens agree."""
    if df.empty:
        return pd.DataFrame()
    df = df.assign(_v=df.apply(tp_variant, axis=1))
    compared = df["compared"] if "compared" in df else pd.Series(None, index=df.index)
    # every row records its own env date, so a run is its invocation; older rows have none: their file,
    # model and rank count, dated by the first of those rows
    invocation = df["invocation"] if "invocation" in df else pd.Series(None, index=df.index)
    dates = df["env_date"].astype(str) if "env_date" in df else pd.Series("no date", index=df.index)
    first = dates.groupby([df["source_file"], df["model_name"], df["tp_compared"]]).transform("min")
    df = df.assign(compared=compared.where(compared.notna(), "tp1,model"), _run=invocation.where(invocation.notna(), first))
    keys = ["source_file", "_run", "machine", "model_name", "impl", "batch", "tp_compared", "compared"]
    out = []
    for key, g in df.groupby(keys, sort=False, dropna=False):
        rec = dict(zip(keys, key))
        rec["session"] = f"{Path(str(key[0])).name} @ {key[1]}"
        rec["shape"] = _tp_shape(g["shape"].iloc[0]) if "shape" in g else ""
        rec["backend"] = ", ".join(sorted(g["backend"].astype(str).unique()))
        rec.update(_tp_pair(g))
        out.append(rec)
    cols = ["session", "machine", "model_name", "shape", "backend", "impl", "batch", "tp_compared", "compared"]
    frame = pd.DataFrame(out)
    return frame[cols + [c for c in frame.columns if c not in cols and c not in ("source_file", "_run")]]


# -- metrics for baseline comparison --------------------------------------------------------------

_METRICS = {
    # table: (key columns, [(metric, value column prefix, unit, better)])
    "decode": (["machine", "model", "weights", "impl", "kv", "context"],
               [("decode tok/s", "decode_tps", "tok/s", "higher")]),
    "pipeline": (["machine", "model", "mode", "stages", "streams", "return"],
                 [("tok/s", "tok_s", "tok/s", "higher")]),
    "serve": (["machine", "server", "arrival", "max_tokens", "concurrency"],
              [("TTFT p50", "ttft_p50_ms", "ms", "lower"), ("ITL p50", "itl_p50_ms", "ms", "lower"),
               ("aggregate throughput", "agg_tps", "tok/s", "higher")]),
    "disagg_handoff": (["machine", "topology", "target_prompt_tokens"],
                       [("TTFT", "ttft_ms", "ms", "lower"), ("handoff stream", "handoff_ms", "ms", "lower")]),
    "disagg_serve": (["machine", "topology", "prompt", "max_tokens", "concurrency"],
                     [("TTFT p50", "ttft_p50_ms", "ms", "lower"), ("ITL p50", "itl_p50_ms", "ms", "lower"),
                      ("aggregate throughput", "agg_tps", "tok/s", "higher")]),
}


def _latest(df: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """Where several sessions measured the same configuration, keep the latest (sessions end in their date)."""
    order = df["session"].str.rsplit("@", n=1).str[-1]
    return df.assign(_when=order).sort_values("_when").groupby(keys, dropna=False, sort=False).tail(1)


def metrics(summaries: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """Headline metrics as one long table: bench, key, metric, unit, better, median, min, max, n, session."""
    out = []
    for bench, (keys, specs) in _METRICS.items():
        df = summaries.get(bench, pd.DataFrame())
        if df.empty:
            continue
        for _, r in _latest(df, keys).iterrows():
            key = " | ".join(f"{k}={r[k]}" for k in keys)
            for metric, col, unit, better in specs:
                if pd.isna(r[f"{col}_median"]):
                    continue
                out.append({"bench": bench, "key": key, "metric": metric, "unit": unit, "better": better,
                            "median": r[f"{col}_median"], "min": r[f"{col}_min"], "max": r[f"{col}_max"],
                            "n": int(r[f"{col}_n"]), "session": r["session"]})
    tp = summaries.get("tp", pd.DataFrame())
    if not tp.empty:
        keys = ["machine", "model_name", "impl", "batch", "compared"]
        for _, r in _latest(tp, keys).iterrows():
            for side in "ab":
                if pd.isna(r.get(f"{side}_tok_s_median")):
                    continue
                key = " | ".join(f"{k}={r[k]}" for k in keys) + f" | config={r[side]}"
                out.append({"bench": "tp", "key": key, "metric": "decode tok/s", "unit": "tok/s", "better": "higher",
                            "median": r[f"{side}_tok_s_median"], "min": r[f"{side}_tok_s_min"],
                            "max": r[f"{side}_tok_s_max"], "n": int(r[f"{side}_tok_s_n"]), "session": r["session"]})
    frame = summaries.get("frame", pd.DataFrame())
    if not frame.empty:
        keys = ["machine", "link", "suite", "payload_bytes"]
        for _, r in _latest(frame, keys).iterrows():
            key = " | ".join(f"{k}={r[k]}" for k in keys)
            for metric, col, unit, better in (("one-way p50", "p50_us", "us", "lower"),
                                              ("one-way bandwidth", "one_way_gib_s", "GiB/s", "higher")):
                out.append({"bench": "frame", "key": key, "metric": metric, "unit": unit, "better": better,
                            "median": r[col], "min": r[col], "max": r[col], "n": 1, "session": r["session"]})
    return pd.DataFrame(out, columns=["bench", "key", "metric", "unit", "better", "median", "min", "max", "n",
                                      "session"])
