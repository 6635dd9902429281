"""Structured output's cost: tokens/s with and without a JSON schema on one server, same prompts, ABBA.

    python -m bench.structured_bench --model-dir models/smollm2-135m-instruct --concurrency 1,32 --rounds 4 \\
        --out bench/results/2026-12-07/cpu-structured-output --label cpu-2core-shared
    python -m bench.structured_bench --url http://127.0.0.1:8080 --concurrency 1,32   # a running server

One server (launched here with ``--parallel`` at least the largest level, or ``--url``) gets the same streaming chat
requests (``bench.serve_bench``'s texts, ``ignore_eos``) twice per level and round: ``plain``, and ``json_schema``
with a ``response_format`` whose documents (an object holding a long array of strings) are longer than
``--max-tokens``, so the grammar never ends a request early and both sides generate the same number of tokens
(checked: ``same_tokens``). Which side goes first flips every level and every round (ABBA), so load from other jobs
on a shared machine hits both alike; each row records the host's load (``os.getloadavg``).

Rows (``bench: structured_output``): one per side, level and round (``mode`` plain / json_schema: aggregate tok/s,
mean and median gap between streamed tokens), then one ``summary`` per level: the per-round ratios json_schema /
plain of aggregate tok/s and of the mean inter-token gap, their mean and range, and ``cost_pct``, the
per-token cost of the mask (mean gap ratio - 1, in percent). The goal (issue 42): under 5 %.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench import serve_bench as sb
from bench.environment import write_jsonl

MODES = ("plain", "json_schema")
#: a document longer than any --max-tokens here: 48 strings of 8 characters at least, about 200 tokens at least
SCHEMA = {"type": "object", "properties": {"items": {
    "type": "array", "items": {"type": "string", "minLength": 8, "maxLength": 40}, "minItems": 48}},
    "required": ["items"], "additionalProperties": False}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "list", "schema": SCHEMA, "strict": True}}


def extra_body(mode: str) -> dict[str, Any] | None:
    """What a side adds to every request: nothing, or the ``response_format``."""
    return {"response_format": RESPONSE_FORMAT} if mode == "json_schema" else None


def loads() -> tuple[float | None, float | None]:
    """The host's 1- and 5-minute load averages (other jobs sharing the cores, and this benchmark's own)."""
    if not hasattr(os, "getloadavg"):
        return None, None
    one, five, _ = os.getloadavg()
    return round(one, 2), round(five, 2)


def level_row(mode: str, url: str, model: str, n: int, args: argparse.Namespace, rnd: int, order: int) -> dict:
    """One side of one level: ``n`` clients, ``--requests`` each, the round's prompts."""
    tag = f"r{rnd}-c{n}"  # the same tag on both sides: the same texts
    results, wall = asyncio.run(sb.run_level(url, model, n, args.requests, args.max_tokens, True, tag=tag,
                                             extra_body=extra_body(mode)))
    row = sb.summarize(mode, url, n, results, wall, args.max_tokens)
    gaps = [g for r in results if r.ok for g in r.gaps]
    tokens = sorted({r.tokens for r in results if r.ok})
    one, five = loads()
    return {"bench": "structured_output", "mode": mode, "label": args.label, "model": model,
            "concurrency": n, "round": rnd, "order": order, "requests": row["requests"], "errors": row["errors"],
            "error_sample": row["error_sample"], "max_tokens": args.max_tokens, "output_tokens": row["output_tokens"],
            "tokens_min": tokens[0] if tokens else 0, "tokens_max": tokens[-1] if tokens else 0,
            "wall_s": row["wall_s"], "agg_tps": row["agg_tps"], "itl_p50_ms": row["itl_p50_ms"],
            "itl_mean_ms": round(1000 * sum(gaps) / len(gaps), 3) if gaps else None,
            "ttft_p50_ms": row["ttft_p50_ms"], "prompts_sha256": sb.prompts_sha256(tag, n, args.requests),
            "load_1m": one, "load_5m": five}


def _spread(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "min": None, "max": None}
    return {"mean": round(sum(values) / len(values), 4), "min": round(min(values), 4), "max": round(max(values), 4)}


def summaries(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per level: json_schema / plain per round (aggregate tok/s, mean inter-token gap), mean and range."""
    out = []
    for n in dict.fromkeys(r["concurrency"] for r in rows):
        level = [r for r in rows if r["concurrency"] == n]
        by = {(r["mode"], r["round"]): r for r in level}
        rounds = sorted({r["round"] for r in level if ("plain", r["round"]) in by and ("json_schema", r["round"]) in by})
        pairs = [(by["plain", k], by["json_schema", k]) for k in rounds]
        tps = _spread([s["agg_tps"] / p["agg_tps"] for p, s in pairs if p["agg_tps"] and s["agg_tps"]])
        itl = _spread([s["itl_mean_ms"] / p["itl_mean_ms"] for p, s in pairs if p["itl_mean_ms"] and s["itl_mean_ms"]])
        mean = lambda mode, key: round(sum(r[key] for r in level if r["mode"] == mode) /  # noqa: E731
                                       max(1, sum(1 for r in level if r["mode"] == mode)), 3)
        out.append({
            "bench": "structured_output", "mode": "summary", "label": level[0]["label"], "model": level[0]["model"],
            "concurrency": n, "rounds": len(pairs), "max_tokens": level[0]["max_tokens"],
            "same_tokens": all(r["tokens_min"] == r["tokens_max"] == r["max_tokens"] and not r["errors"] for r in level),
            "plain_tps": mean("plain", "agg_tps"), "schema_tps": mean("json_schema", "agg_tps"),
            "plain_itl_ms": mean("plain", "itl_mean_ms"), "schema_itl_ms": mean("json_schema", "itl_mean_ms"),
            "tps_ratio": tps["mean"], "tps_ratio_min": tps["min"], "tps_ratio_max": tps["max"],
            "itl_ratio": itl["mean"], "itl_ratio_min": itl["min"], "itl_ratio_max": itl["max"],
            "cost_pct": round(100 * (itl["mean"] - 1), 2) if itl["mean"] is not None else None,
            "load_1m_max": max((r["load_1m"] for r in level if r["load_1m"] is not None), default=None),
        })
    return out


def run(url: str, model: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every level, every round, both sides in ABBA order (``serve_bench.level_order``)."""
    rows: list[dict[str, Any]] = []
    for n in args.concurrency:  # unrecorded: the batch shapes and the grammar's first compile
        for mode in MODES:
            asyncio.run(sb.run_level(url, model, n, 1, 8, True, tag=f"warm-{n}", extra_body=extra_body(mode)))
    for rnd in range(args.rounds):
        for j, n in enumerate(args.concurrency):
            for order, mode in enumerate(sb.level_order(list(MODES), rnd, j)):
                row = level_row(mode, url, model, n, args, rnd, order)
                print(f"r{rnd} c={n:<3} {mode:>11} {row['agg_tps']} tok/s  itl {row['itl_mean_ms']} ms  "
                      f"tokens {row['tokens_min']}-{row['tokens_max']}  load {row['load_1m']}", file=sys.stderr, flush=True)
                rows.append(row)
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="a running server (default: launch mlxcel serve on --model-dir)")
    p.add_argument("--model-dir", default="models/smollm2-135m-instruct", help="checkpoint to launch")
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 32])
    p.add_argument("--requests", type=int, default=2, help="requests per client per level (default 2)")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens per request, both sides (default 48)")
    p.add_argument("--rounds", type=int, default=4, help="ABBA rounds (default 4)")
    p.add_argument("--label", default="", help="a label for the rows (the machine and its load)")
    p.add_argument("--out", type=Path, default=sb.DEFAULT_OUT, help="directory of structured_output.jsonl")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    proc = None
    try:
        url = args.url
        if url is None:
            url = f"http://127.0.0.1:{sb._free_port()}"  # noqa: SLF001 - the launcher's own helper
            command = sb.launch_command("mlxcel", args.model_dir, int(url.rsplit(":", 1)[1]), max(args.concurrency))
            proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            sb.wait_until_serving(url, proc)
        model = sb.model_name(url, "mlxcel" if proc else None, args.model_dir)
        sb.warm(url, model)
        rows = run(url, model, args)
    finally:
        if proc is not None:
            sb.stop(proc)
    summary = summaries(rows)
    for s in summary:
        print(f"c={s['concurrency']:<3} json_schema / plain: tok/s x{s['tps_ratio']} ({s['tps_ratio_min']}-"
              f"{s['tps_ratio_max']}), per-token gap x{s['itl_ratio']} ({s['itl_ratio_min']}-{s['itl_ratio_max']}), "
              f"cost {s['cost_pct']} %  same tokens: {s['same_tokens']}  load <= {s['load_1m_max']}", file=sys.stderr)
    stamp = time.strftime("%Y%m%dT%H%M%S")
    path = write_jsonl(args.out / "structured_output.jsonl", [{**r, "run": stamp} for r in rows + summary])
    print(f"structured_bench: {len(rows) + len(summary)} rows -> {path}", file=sys.stderr)
    return 1 if any(r["errors"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
