"""``mlxcel generate``: stream a completion to the terminal, then one line of statistics."""

from __future__ import annotations

import argparse
import sys

import mlx.core as mx

from mlxcel.blas import blas_in_use
from mlxcel.engine.generate import GenerationStats, stream_generate
from mlxcel.engine.prompts import PromptError, encode_chat, encode_raw
from mlxcel.engine.sampling import SamplingParams
from mlxcel.models.loading import load_checkpoint


def _prompt_text(args: argparse.Namespace) -> str:
    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not text.strip():
        raise PromptError("prompt must not be empty")
    return text


def format_stats(stats: GenerationStats) -> str:
    return (
        f"prompt: {stats.prompt_tokens} tokens, {stats.prompt_tps:.1f} tok/s | "
        f"decode: {stats.generation_tokens} tokens, {stats.decode_tps:.1f} tok/s | "
        f"peak memory: {stats.peak_memory_gb:.2f} GB"
    )


def run_generate(args: argparse.Namespace) -> int:
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.seed, stop=tuple(args.stop),
    )
    text = _prompt_text(args)
    loaded = load_checkpoint(args.model)
    print(f"model: {loaded.name} ({loaded.model_type}, {loaded.num_layers} layers) | "
          f"weights: {loaded.describe_weights()} | device: {mx.default_device()} | blas: {blas_in_use()}",
          file=sys.stderr)
    if args.raw:
        prompt = encode_raw(loaded.tokenizer, text)
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        prompt = encode_chat(loaded.tokenizer, messages + [{"role": "user", "content": text}])
    stats = GenerationStats()
    for chunk in stream_generate(loaded.model, loaded.tokenizer, prompt, params, stats=stats):
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    print(format_stats(stats), file=sys.stderr)
    return 0
