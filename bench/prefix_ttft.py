"""Time to first token with a long shared prefix, cold vs warm, through a running server or coordinator.

Each run makes a prefix of ``--prefix-tokens`` token ids that no earlier request used, then streams
two completions: the prefix + question A (cold: nothing of it is cached) and the prefix + question
B (warm: the prefix cache holds the prefix, so only the question is prefilled). TTFT is the time
from sending the request to its first streamed token. The server's /metrics tell how many prompt
tokens the warm request took from the cache.

    .venv/bin/python -m bench.prefix_ttft --url http://127.0.0.2:8080 -m models/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

WORDS = ("the river crossed a valley where farmers kept bees and grew barley under old stone walls while "
         "merchants carried salt wool copper and paper along roads that the kingdom repaired every spring").split()
QUESTIONS = (" Question: In one sentence, what did the merchants carry? Answer:",
             " Question: Name one thing the farmers kept. Answer:")


def prefix_ids(tokenizer: Any, n: int, seed: int) -> list[int]:
    """``n`` token ids of shuffled prose that depend on ``seed`` (so every run's prefix is new)."""
    rng = random.Random(seed)
    ids: list[int] = []
    while len(ids) < n:
        words = rng.sample(WORDS, len(WORDS))
        ids += tokenizer.encode(f"Section {seed}.{len(ids)}: " + " ".join(words) + ".\n", add_special_tokens=False)
    return ids[:n]


def first_token_s(url: str, model: str, prompt: list[int], max_tokens: int) -> tuple[float, str]:
    """(seconds to the first streamed token, the whole text)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    start = time.perf_counter()
    first, text = None, []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or []
            if choices and first is None:
                first = time.perf_counter() - start
            text += [c.get("text") or "" for c in choices]
    if first is None:
        raise RuntimeError("the stream ended without a token")
    return first, "".join(text)


def prefix_counters(url: str) -> tuple[float, float]:
    """(prefix-cache hits, reused tokens) from the server's /metrics."""
    found = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("mlxcel_prefix_cache_hits_total", "mlxcel_prefix_cache_reused_tokens_total"):
            found[name] = float(value)
    return found.get("mlxcel_prefix_cache_hits_total", 0.0), found.get("mlxcel_prefix_cache_reused_tokens_total", 0.0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True, help="the server or coordinator, e.g. http://127.0.0.2:8080")
    p.add_argument("-m", "--model", required=True, help="checkpoint directory (its tokenizer builds the prefixes)")
    p.add_argument("--served-model-name", default=None, help="the model id the server expects (default: the directory name)")
    p.add_argument("--prefix-tokens", type=int, default=1000)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--label", default="", help="recorded in each row (e.g. pipeline-2-stages)")
    p.add_argument("--out", default=None, help="append JSONL rows (with the environment) to this file")
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = args.served_model_name or Path(args.model).resolve().name
    questions = [tokenizer.encode(q, add_special_tokens=False) for q in QUESTIONS]
    seed0 = int(time.time())
    rows = []
    for run in range(args.runs):
        prefix = prefix_ids(tokenizer, args.prefix_tokens, seed0 + run)
        cold_s, _ = first_token_s(args.url, model, prefix + questions[0], args.max_tokens)
        hits, reused = prefix_counters(args.url)
        warm_s, _ = first_token_s(args.url, model, prefix + questions[1], args.max_tokens)
        hits2, reused2 = prefix_counters(args.url)
        row = {"bench": "prefix_ttft", "label": args.label, "run": run, "prefix_tokens": args.prefix_tokens,
               "prompt_tokens": len(prefix) + len(questions[1]), "cold_ttft_s": round(cold_s, 4),
               "warm_ttft_s": round(warm_s, 4), "warm_reused_tokens": int(reused2 - reused), "warm_hit": hits2 > hits}
        rows.append(row)
        print(f"run {run + 1}/{args.runs}: cold {cold_s:.3f} s, warm {warm_s:.3f} s "
              f"({row['warm_reused_tokens']} prompt tokens from the cache)", file=sys.stderr, flush=True)
    cold = statistics.median(r["cold_ttft_s"] for r in rows)
    warm = statistics.median(r["warm_ttft_s"] for r in rows)
    print(f"median TTFT: cold {cold:.3f} s, warm {warm:.3f} s ({cold / warm:.1f}x)")
    if args.out:
        from bench.environment import write_jsonl

        write_jsonl(args.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
