"""What ``--kv-bits`` costs in quality and saves in memory, against a full-precision KV cache.

For each prompt (chat-templated), the full-precision cache generates ``--tokens`` greedy tokens. Then for each
``--bits``, with mlx-lm's ``QuantizedKVCache`` (what ``--kv-bits`` makes, ``mlxcel.engine.kv_quant``):

- greedy agreement: the quantized run's own greedy tokens equal the reference's up to the first difference
  (``agree_prefix``; ``agree`` = agree_prefix / tokens, 1.0 = identical text);
- logit error: teacher-forced along the reference tokens, the largest and mean absolute difference of the
  last-position logits (float32) from the full-precision ones, and how often the top-1 token still agrees;
- KV bytes per token: the cache's arrays over its positions (all layers), for the model's dtype.

One JSON row per (prompt, bits) plus a summary row per bits, appended with the environment under "env":

    .venv/bin/python -m bench.kv_bits_quality -m models/smollm2-135m-instruct --tokens 32
"""

from __future__ import annotations

import argparse
import datetime as _dt
import statistics
import sys
from pathlib import Path
from typing import Any

PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers greater than ten.",
    "Give one tip for learning a new language.",
)


def _caches(model: Any, bits: int | None, group_size: int) -> list:
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    layers = len(model.layers)
    if bits is None:
        return [KVCache() for _ in range(layers)]
    return [QuantizedKVCache(group_size=group_size, bits=bits) for _ in range(layers)]


def _last_logits(model: Any, ids: list[int], cache: list) -> Any:
    import mlx.core as mx

    out = model(mx.array([ids]), cache=cache)[:, -1, :].astype(mx.float32)
    mx.eval(out)
    return out[0]


def greedy(model: Any, prompt: list[int], n: int, bits: int | None, group_size: int) -> list[int]:
    import mlx.core as mx

    cache, tokens = _caches(model, bits, group_size), []
    logits = _last_logits(model, prompt, cache)
    for _ in range(n):
        tokens.append(int(mx.argmax(logits).item()))
        logits = _last_logits(model, [tokens[-1]], cache)
    return tokens


def forced_logits(model: Any, prompt: list[int], tokens: list[int], bits: int | None, group_size: int) -> list:
    """Last-position logits before each of ``tokens``, feeding ``tokens`` whatever the cache would pick."""
    cache = _caches(model, bits, group_size)
    out = [_last_logits(model, prompt, cache)]
    for t in tokens[:-1]:
        out.append(_last_logits(model, [t], cache))
    return out


def kv_bytes_per_token(model: Any, prompt: list[int], bits: int | None, group_size: int) -> float:
    """Bytes every layer's cache holds per position (its arrays cut to the positions written)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    cache = _caches(model, bits, group_size)
    _last_logits(model, prompt, cache)
    total = 0
    for c in cache:
        keys_values = (c.keys, c.values)
        total += sum(a[..., : c.offset, :].nbytes for _, a in tree_flatten(keys_values) if isinstance(a, mx.array))
    return total / len(prompt)


def compare(model: Any, prompt: list[int], ref: list[int], full: list, bits: int, group_size: int) -> dict:
    import mlx.core as mx

    own = greedy(model, prompt, len(ref), bits, group_size)
    prefix = next((i for i, (a, b) in enumerate(zip(own, ref)) if a != b), len(ref))
    forced = forced_logits(model, prompt, ref, bits, group_size)
    diffs = [mx.abs(q - f) for q, f in zip(forced, full)]
    top1 = [int(mx.argmax(q).item()) == t for q, t in zip(forced, ref)]
    return {"bits": bits, "group_size": group_size, "tokens": len(ref), "agree_prefix": prefix,
            "agree": prefix / len(ref), "top1_agree": sum(top1) / len(top1),
            "max_logit_err": max(float(d.max().item()) for d in diffs),
            "mean_logit_err": statistics.fmean(float(d.mean().item()) for d in diffs),
            "logit_range": float(max(mx.abs(f).max().item() for f in full))}


def run(model_dir: str, tokens: int, bits_list: list[int], group_size: int, prompts: int) -> list[dict]:
    from mlxcel.models.loading import load_checkpoint

    loaded = load_checkpoint(model_dir)
    model, tok = loaded.model, loaded.tokenizer
    rows: list[dict] = []
    encoded = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
               for p in PROMPTS[:prompts]]
    bytes_full = kv_bytes_per_token(model, encoded[0], None, group_size)
    per_bits: dict[int, list[dict]] = {b: [] for b in bits_list}
    for i, prompt in enumerate(encoded):
        ref = greedy(model, prompt, tokens, None, group_size)
        full = forced_logits(model, prompt, ref, None, group_size)
        for bits in bits_list:
            row = {"kind": "prompt", "prompt": i, **compare(model, prompt, ref, full, bits, group_size)}
            per_bits[bits].append(row)
            rows.append(row)
    for bits in bits_list:
        got = per_bits[bits]
        rows.append({"kind": "summary", "bits": bits, "group_size": group_size, "prompts": len(got), "tokens": tokens,
                     "identical_texts": sum(r["agree_prefix"] == tokens for r in got),
                     "agree": statistics.fmean(r["agree"] for r in got),
                     "top1_agree": statistics.fmean(r["top1_agree"] for r in got),
                     "max_logit_err": max(r["max_logit_err"] for r in got),
                     "mean_logit_err": statistics.fmean(r["mean_logit_err"] for r in got),
                     "kv_bytes_per_token": kv_bytes_per_token(model, encoded[0], bits, group_size),
                     "kv_bytes_per_token_full": bytes_full})
    return [{"bench": "kv_bits_quality", "model": Path(model_dir).name, **r} for r in rows]


def table(rows: list[dict]) -> str:
    lines = ["| KV cache | identical texts | greedy agreement | top-1 (forced) | max logit err | mean logit err | "
             "KV bytes/token |", "|---|---|---|---|---|---|---|"]
    summaries = [r for r in rows if r["kind"] == "summary"]
    if summaries:
        s = summaries[0]
        lines.append(f"| full precision | - | - | - | 0 | 0 | {s['kv_bytes_per_token_full']:.0f} |")
    for s in summaries:
        lines.append(f"| {s['bits']}-bit, group {s['group_size']} | {s['identical_texts']}/{s['prompts']} | "
                     f"{s['agree']:.3f} | {s['top1_agree']:.3f} | {s['max_logit_err']:.3f} | {s['mean_logit_err']:.4f} | "
                     f"{s['kv_bytes_per_token']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-m", "--model", default="models/smollm2-135m-instruct")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--prompts", type=int, default=len(PROMPTS), choices=range(1, len(PROMPTS) + 1))
    p.add_argument("--bits", default="4,8", help="comma-separated --kv-bits values (default 4,8)")
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--out", default=None, help="JSONL to append to (default bench/results/<date>/kv-bits/...)")
    args = p.parse_args(argv)
    from bench.environment import write_jsonl

    rows = run(args.model, args.tokens, [int(b) for b in args.bits.split(",")], args.group_size, args.prompts)
    day = _dt.date.today().isoformat()
    out = write_jsonl(args.out or f"bench/results/{day}/kv-bits/kv_bits_quality.jsonl", rows)
    print(table(rows))
    print(f"rows: {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
