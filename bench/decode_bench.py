"""Single-device decode benchmark: mlxcel's generation side by side with mlx-lm's own.

Both run greedy over the same loaded checkpoint and prompt, interleaved run by
run, with end-of-sequence disabled so every run produces exactly --tokens
tokens. Per run: prompt tok/s, decode tok/s, per-token latency p50/p95, peak
memory. Rows go to JSONL (with the environment) and the summary prints the
median decode ratio mlxcel / mlx-lm.

    python -m bench.decode_bench -m models/smollm2-135m-instruct --runs 5 --tokens 64
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import contextmanager
from typing import Callable, Iterator

import mlxcel  # noqa: F401  (before mlx.core: picks up OpenBLAS, see mlxcel/blas.py)
import mlx.core as mx

from bench.environment import write_jsonl
from bench.stats import percentile
from mlxcel.engine.generate import GenerationStats, stream_generate
from mlxcel.engine.prompts import encode_prompt
from mlxcel.engine.sampling import SamplingParams
from mlxcel.models.loading import LoadedModel, load_checkpoint

DEFAULT_PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


@contextmanager
def eos_disabled(tokenizer) -> Iterator[None]:
    saved = set(tokenizer.eos_token_ids)
    tokenizer.eos_token_ids = set()
    try:
        yield
    finally:
        tokenizer.eos_token_ids = saved


def run_mlxcel(loaded: LoadedModel, prompt: list[int], tokens: int) -> dict:
    stats = GenerationStats()
    for _ in stream_generate(loaded.model, loaded.tokenizer, prompt, SamplingParams(max_tokens=tokens), stats=stats):
        pass
    return _row(stats.prompt_tokens, stats.prompt_seconds, stats.token_times, stats.peak_memory_gb)


def run_mlx_lm(loaded: LoadedModel, prompt: list[int], tokens: int) -> dict:
    from mlx_lm.generate import stream_generate as mlx_lm_stream_generate

    mx.reset_peak_memory()
    start = last = time.perf_counter()
    prompt_seconds, gaps = 0.0, []
    for n, _ in enumerate(mlx_lm_stream_generate(loaded.model, loaded.tokenizer, mx.array(prompt), max_tokens=tokens)):
        now = time.perf_counter()
        if n == 0:
            prompt_seconds = now - start
        else:
            gaps.append(now - last)
        last = now
    return _row(len(prompt), prompt_seconds, gaps, mx.get_peak_memory() / 1e9)


def _ms(seconds: float | None) -> float:
    return float("nan") if seconds is None else seconds * 1e3


def _row(prompt_tokens: int, prompt_seconds: float, gaps: list[float], peak_gb: float) -> dict:
    decode_seconds = sum(gaps)
    return {
        "prompt_tokens": prompt_tokens,
        "generated_tokens": len(gaps) + 1,
        "prompt_tps": prompt_tokens / prompt_seconds,
        "decode_tps": len(gaps) / decode_seconds if decode_seconds else 0.0,
        "token_latency_p50_ms": _ms(percentile(gaps, 50)),
        "token_latency_p95_ms": _ms(percentile(gaps, 95)),
        "peak_memory_gb": peak_gb,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-m", "--model", default="models/smollm2-135m-instruct")
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--tokens", type=int, default=64, help="tokens generated per run")
    p.add_argument("--runs", type=int, default=5, help="measured runs per implementation (interleaved)")
    p.add_argument("--out", default="results/decode_bench.jsonl")
    args = p.parse_args(argv)

    loaded = load_checkpoint(args.model)
    prompt = encode_prompt(loaded.tokenizer, args.prompt)
    impls: dict[str, Callable[[LoadedModel, list[int], int], dict]] = {"mlxcel": run_mlxcel, "mlx-lm": run_mlx_lm}
    print(f"model {loaded.name}: weights {loaded.describe_weights()}, device {mx.default_device()}, "
          f"prompt {len(prompt)} tokens, {args.tokens} tokens x {args.runs} runs", file=sys.stderr)
    rows: list[dict] = []
    with eos_disabled(loaded.tokenizer):
        for impl in impls.values():  # warm-up, not recorded
            impl(loaded, prompt, 4)
        for run in range(args.runs):
            for name, impl in impls.items():
                row = {"bench": "decode", "impl": name, "run": run, "model": loaded.name,
                       "weights": loaded.describe_weights(), **impl(loaded, prompt, args.tokens)}
                rows.append(row)
                print(f"  run {run} {name:7s} prompt {row['prompt_tps']:7.1f} tok/s  decode {row['decode_tps']:6.2f} tok/s"
                      f"  p50 {row['token_latency_p50_ms']:6.1f} ms  p95 {row['token_latency_p95_ms']:6.1f} ms"
                      f"  peak {row['peak_memory_gb']:.2f} GB", file=sys.stderr)
    summary = summarize(rows)
    rows.append({"bench": "decode", "impl": "summary", "model": loaded.name, **summary})
    out = write_jsonl(args.out, rows)
    print(f"median decode: mlxcel {summary['mlxcel_decode_tps']:.2f} tok/s, mlx-lm {summary['mlx_lm_decode_tps']:.2f} tok/s, "
          f"ratio {summary['decode_ratio']:.3f} (median of per-run ratios {summary['median_run_ratio']:.3f}); "
          f"prompt ratio {summary['prompt_ratio']:.3f}; rows -> {out}")
    return 0


def summarize(rows: list[dict]) -> dict:
    def med(impl: str, key: str) -> float:
        return statistics.median(r[key] for r in rows if r["impl"] == impl)

    ours = [r for r in rows if r["impl"] == "mlxcel"]
    theirs = [r for r in rows if r["impl"] == "mlx-lm"]
    run_ratios = [a["decode_tps"] / b["decode_tps"] for a, b in zip(ours, theirs)]
    return {
        "mlxcel_decode_tps": med("mlxcel", "decode_tps"),
        "mlx_lm_decode_tps": med("mlx-lm", "decode_tps"),
        "decode_ratio": med("mlxcel", "decode_tps") / med("mlx-lm", "decode_tps"),
        "median_run_ratio": statistics.median(run_ratios),
        "prompt_ratio": med("mlxcel", "prompt_tps") / med("mlx-lm", "prompt_tps"),
    }


if __name__ == "__main__":
    sys.exit(main())
