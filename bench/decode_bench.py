"""Single-device decode benchmark: mlxcel's generation side by side with mlx-lm's own.

Both run greedy over the same loaded checkpoint and prompt, interleaved run by
run, with end-of-sequence disabled so every run produces exactly --tokens
tokens. Per run: prompt tok/s, decode tok/s, per-token latency p50/p95, peak
memory and the KV cache's bytes. Rows go to JSONL (with the environment) and the
summary prints the median decode ratio mlxcel / mlx-lm per context and KV variant.

    python -m bench.decode_bench -m models/smollm2-135m-instruct --runs 5 --tokens 64

``--kv-bits 0 8 4`` compares the full-precision cache (0) with quantized ones (mlxcel: ``--kv-bits``'s
``use_kv_bits``; mlx-lm: its ``stream_generate(kv_bits=..., quantized_kv_start=0)``), and ``--prompt-tokens
512 2048 6144`` sets the context: the chat prompt's own tokens repeated and cut to that many, identical for
every variant. Each run visits every (variant, implementation) pair, reversed on odd runs (ABBA), in one
process over one loaded checkpoint. KV bytes are read from the cache objects after a run: every layer's keys
and values cut to the positions written (``kv_cache_bytes``), and as allocated (``kv_cache_alloc_bytes``,
mlx-lm's caches grow in steps of 256 positions).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import mlxcel  # noqa: F401  (before mlx.core: picks up OpenBLAS, see mlxcel/blas.py)
import mlx.core as mx
from mlx.utils import tree_flatten

from bench.environment import write_jsonl
from bench.stats import percentile
from mlxcel.engine.generate import GenerationStats, stream_generate
from mlxcel.engine.kv_quant import kv_quant, use_kv_bits
from mlxcel.engine.prompts import encode_prompt
from mlxcel.engine.sampling import SamplingParams
from mlxcel.models.loading import LoadedModel, load_checkpoint

DEFAULT_PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."

Variant = tuple[int | None, int]  # (kv bits or None for full precision, group size)
Impl = Callable[[LoadedModel, list[int], int, Variant], dict]


@contextmanager
def eos_disabled(tokenizer) -> Iterator[None]:
    saved = set(tokenizer.eos_token_ids)
    tokenizer.eos_token_ids = set()
    try:
        yield
    finally:
        tokenizer.eos_token_ids = saved


@contextmanager
def kv_variant(model: Any, variant: Variant) -> Iterator[None]:
    """mlxcel's caches for ``variant`` while inside (``use_kv_bits``), the model's own afterwards."""
    had, saved = "make_cache" in vars(model), vars(model).get("make_cache")
    use_kv_bits(model, kv_quant(*variant) if variant[0] else None)
    try:
        yield
    finally:
        if had:
            model.make_cache = saved
        else:
            vars(model).pop("make_cache", None)


def cache_bytes(caches: list) -> tuple[int, int, int]:
    """(bytes of the positions written, bytes allocated, positions) over every layer's keys and values."""
    used = alloc = 0
    for c in caches:
        arrays = [a for _, a in tree_flatten((c.keys, c.values)) if isinstance(a, mx.array)]
        used += sum(a[..., : c.offset, :].nbytes for a in arrays)
        alloc += sum(a.nbytes for a in arrays)
    return used, alloc, int(caches[0].offset) if caches else 0


def run_mlxcel(loaded: LoadedModel, prompt: list[int], tokens: int, variant: Variant = (None, 64)) -> dict:
    stats, seen = GenerationStats(), []

    def forward(x: mx.array, c: list) -> mx.array:
        if not seen:
            seen.append(c)
        return loaded.model(x, cache=c)

    with kv_variant(loaded.model, variant):
        for _ in stream_generate(loaded.model, loaded.tokenizer, prompt, SamplingParams(max_tokens=tokens),
                                 forward=forward, stats=stats):
            pass
    return _row(stats.prompt_tokens, stats.prompt_seconds, stats.token_times, stats.peak_memory_gb,
                cache_bytes(seen[0]))


def run_mlx_lm(loaded: LoadedModel, prompt: list[int], tokens: int, variant: Variant = (None, 64)) -> dict:
    from mlx_lm.generate import stream_generate as mlx_lm_stream_generate
    from mlx_lm.models.cache import make_prompt_cache

    caches = make_prompt_cache(loaded.model)  # mlx-lm converts them in place once kv_bits applies
    mx.reset_peak_memory()
    start = last = time.perf_counter()
    prompt_seconds, gaps = 0.0, []
    for n, _ in enumerate(mlx_lm_stream_generate(loaded.model, loaded.tokenizer, mx.array(prompt), max_tokens=tokens,
                                                 prompt_cache=caches, kv_bits=variant[0] or None,
                                                 kv_group_size=variant[1], quantized_kv_start=0)):
        now = time.perf_counter()
        if n == 0:
            prompt_seconds = now - start
        else:
            gaps.append(now - last)
        last = now
    return _row(len(prompt), prompt_seconds, gaps, mx.get_peak_memory() / 1e9, cache_bytes(caches))


def _ms(seconds: float | None) -> float:
    return float("nan") if seconds is None else seconds * 1e3


def _row(prompt_tokens: int, prompt_seconds: float, gaps: list[float], peak_gb: float,
         kv: tuple[int, int, int]) -> dict:
    decode_seconds = sum(gaps)
    return {
        "prompt_tokens": prompt_tokens,
        "generated_tokens": len(gaps) + 1,
        "prompt_tps": prompt_tokens / prompt_seconds,
        "decode_tps": len(gaps) / decode_seconds if decode_seconds else 0.0,
        "token_latency_p50_ms": _ms(percentile(gaps, 50)),
        "token_latency_p95_ms": _ms(percentile(gaps, 95)),
        "peak_memory_gb": peak_gb,
        "kv_cache_bytes": kv[0], "kv_cache_alloc_bytes": kv[1], "kv_cache_positions": kv[2],
    }


IMPLS: dict[str, Impl] = {"mlxcel": run_mlxcel, "mlx-lm": run_mlx_lm}


def long_prompt(tokenizer: Any, text: str, n: int) -> list[int]:
    """``n`` token ids: ``text``'s chat prompt repeated and cut (0: the chat prompt as it is)."""
    base = encode_prompt(tokenizer, text)
    if n <= 0:
        return base
    return (base * (n // len(base) + 1))[:n]


def _context_limit(loaded: LoadedModel) -> int | None:
    limit = getattr(getattr(loaded.model, "args", None), "max_position_embeddings", None)
    return limit if isinstance(limit, int) else None


def _variants(args: argparse.Namespace) -> list[Variant]:
    for bits in args.kv_bits:
        kv_quant(bits or None, args.kv_group_size)  # KVBitsError: one line
    return [(b or None, args.kv_group_size) for b in dict.fromkeys(args.kv_bits)]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-m", "--model", default="models/smollm2-135m-instruct")
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--prompt-tokens", type=int, nargs="+", default=[0], metavar="N",
                   help="context lengths: the prompt repeated and cut to N tokens (0, the default: as it is)")
    p.add_argument("--kv-bits", type=int, nargs="+", default=[0], choices=(0, 4, 8), metavar="BITS",
                   help="KV cache variants: 0 (full precision, the default), 8, 4")
    p.add_argument("--kv-group-size", type=int, default=64, help="group size of the quantized variants")
    p.add_argument("--impls", default="mlxcel,mlx-lm", help="comma-separated: mlxcel, mlx-lm")
    p.add_argument("--tokens", type=int, default=64, help="tokens generated per run")
    p.add_argument("--runs", type=int, default=5, help="measured runs per implementation (interleaved)")
    p.add_argument("--label", default=None, help="recorded in every row (e.g. 'noisy: shared 2-core box')")
    p.add_argument("--out", default="results/decode_bench.jsonl")
    args = p.parse_args(argv)
    unknown = [i for i in args.impls.split(",") if i not in IMPLS]
    if unknown:
        p.error(f"--impls: unknown {', '.join(unknown)} (choose from {', '.join(IMPLS)})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    variants = _variants(args)
    impls = {name: IMPLS[name] for name in args.impls.split(",")}
    loaded = load_checkpoint(args.model)
    prompts = {n: long_prompt(loaded.tokenizer, args.prompt, n) for n in args.prompt_tokens}
    limit = _context_limit(loaded)
    too_long = [len(p) + args.tokens for p in prompts.values() if limit and len(p) + args.tokens > limit]
    if too_long:
        raise SystemExit(f"--prompt-tokens + --tokens = {max(too_long)} is past the model's context of {limit}")
    print(f"model {loaded.name}: weights {loaded.describe_weights()}, device {mx.default_device()}, "
          f"prompts {[len(p) for p in prompts.values()]} tokens, kv {variants}, {args.tokens} tokens x {args.runs} runs",
          file=sys.stderr)
    rows: list[dict] = []
    with eos_disabled(loaded.tokenizer):
        for variant in variants:  # warm-up, not recorded
            for impl in impls.values():
                impl(loaded, prompts[args.prompt_tokens[0]][:64], 4, variant)
        for prompt in prompts.values():
            rows += measure(loaded, prompt, variants, impls, args)
    for prompt in prompts.values():
        for variant in variants:
            part = [r for r in rows if r["prompt_tokens"] == len(prompt) and r["kv_bits"] == variant[0]]
            if {"mlxcel", "mlx-lm"} <= set(impls):
                rows.append(summary_row(part, loaded.name, variant, len(prompt), args.label))
    out = write_jsonl(args.out, rows)
    print(f"rows -> {out}")
    return 0


def measure(loaded: LoadedModel, prompt: list[int], variants: list[Variant], impls: dict[str, Impl],
            args: argparse.Namespace) -> list[dict]:
    """``args.runs`` runs of every (variant, implementation) pair over ``prompt``, ABBA: odd runs reversed."""
    pairs = [(v, name) for v in variants for name in impls]
    rows = []
    for run in range(args.runs):
        for order, (variant, name) in enumerate(pairs if run % 2 == 0 else pairs[::-1]):
            row = {"bench": "decode", "impl": name, "run": run, "order": order, "model": loaded.name,
                   "weights": loaded.describe_weights(), "kv_bits": variant[0],
                   "kv_group_size": variant[1] if variant[0] else None, "label": args.label,
                   "load_1m": os.getloadavg()[0], **impls[name](loaded, prompt, args.tokens, variant)}
            rows.append(row)
            print(f"  ctx {len(prompt)} kv {variant[0] or 'full'} run {run} {name:7s} prompt {row['prompt_tps']:7.1f} "
                  f"tok/s  decode {row['decode_tps']:6.2f} tok/s  p50 {row['token_latency_p50_ms']:6.1f} ms  "
                  f"kv {row['kv_cache_bytes'] / 2**20:7.2f} MiB  peak {row['peak_memory_gb']:.2f} GB  "
                  f"load {row['load_1m']:.1f}", file=sys.stderr)
    return rows


def summary_row(rows: list[dict], model: str, variant: Variant, prompt_tokens: int, label: str | None) -> dict:
    summary = summarize(rows)
    print(f"ctx {prompt_tokens} kv {variant[0] or 'full'}: median decode mlxcel {summary['mlxcel_decode_tps']:.2f} "
          f"tok/s, mlx-lm {summary['mlx_lm_decode_tps']:.2f} tok/s, ratio {summary['decode_ratio']:.3f} "
          f"(median of per-run ratios {summary['median_run_ratio']:.3f}); prompt ratio {summary['prompt_ratio']:.3f}; "
          f"kv {summary['mlxcel_kv_cache_bytes'] / 2**20:.2f} MiB")
    return {"bench": "decode", "impl": "summary", "model": model, "kv_bits": variant[0],
            "kv_group_size": variant[1] if variant[0] else None, "prompt_tokens": prompt_tokens, "label": label,
            **summary}


def summarize(rows: list[dict]) -> dict:
    def med(impl: str, key: str) -> float:
        return statistics.median(r[key] for r in rows if r["impl"] == impl)

    ours = sorted((r for r in rows if r["impl"] == "mlxcel"), key=lambda r: r["run"])
    theirs = sorted((r for r in rows if r["impl"] == "mlx-lm"), key=lambda r: r["run"])
    run_ratios = [a["decode_tps"] / b["decode_tps"] for a, b in zip(ours, theirs)]
    out = {
        "mlxcel_decode_tps": med("mlxcel", "decode_tps"),
        "mlx_lm_decode_tps": med("mlx-lm", "decode_tps"),
        "decode_ratio": med("mlxcel", "decode_tps") / med("mlx-lm", "decode_tps"),
        "median_run_ratio": statistics.median(run_ratios),
        "prompt_ratio": med("mlxcel", "prompt_tps") / med("mlx-lm", "prompt_tps"),
    }
    if all("kv_cache_bytes" in r for r in rows):
        out["mlxcel_kv_cache_bytes"] = med("mlxcel", "kv_cache_bytes")
        out["mlx_lm_kv_cache_bytes"] = med("mlx-lm", "kv_cache_bytes")
    return out


if __name__ == "__main__":
    sys.exit(main())
