"""``mlxcel generate``: stream a completion to the terminal, then one line of statistics."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlxcel.blas import blas_in_use
from mlxcel.cluster.secret import load_secret
from mlxcel.config import DEFAULT_PP_MICRO_BATCH_SIZE
from mlxcel.engine.generate import GenerationStats, stream_generate
from mlxcel.engine.prompts import PromptError, encode_chat, encode_raw
from mlxcel.engine.sampling import SamplingParams
from mlxcel.errors import CLIError
from mlxcel.models.loading import check_checkpoint, load_checkpoint
from mlxcel.parallel.options import prepare_tp, tp_secret
from mlxcel.pipeline.inprocess import InProcessPipeline, stage_ranges
from mlxcel.topology.partition import PartitionError


def _prompt_text(args: argparse.Namespace) -> str:
    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not text.strip():
        raise PromptError("prompt must not be empty")
    return text


def describe_model(loaded: Any) -> str:
    """The start-up line: name, family, layers, weights, device, BLAS."""
    return (f"model: {loaded.name} ({loaded.model_type}, {loaded.num_layers} layers) | "
            f"weights: {loaded.describe_weights()} | device: {mx.default_device()} | blas: {blas_in_use()}")


def encode_prompt(args: argparse.Namespace, tokenizer: Any, text: str) -> list[int]:
    """``text`` as token ids: raw with --raw, else through the chat template (with --system)."""
    if args.raw:
        return encode_raw(tokenizer, text)
    messages = ([{"role": "system", "content": args.system}] if args.system else [])
    return encode_chat(tokenizer, messages + [{"role": "user", "content": text}])


def format_stats(stats: GenerationStats) -> str:
    return (
        f"prompt: {stats.prompt_tokens} tokens, {stats.prompt_tps:.1f} tok/s | "
        f"decode: {stats.generation_tokens} tokens, {stats.decode_tps:.1f} tok/s | "
        f"peak memory: {stats.peak_memory_gb:.2f} GB"
    )


def _pipeline(args: argparse.Namespace, loaded: Any) -> Any:
    """The whole model, or with --pp-size/--pp-layers an in-process chain of stages."""
    if getattr(args, "cluster_secret_file", None) is not None:
        load_secret(args.cluster_secret_file)  # checked like the server does; in-process stages need no transport
    if getattr(args, "pp_size", 1) < 2 and getattr(args, "pp_layers", None) is None:
        return loaded.model
    try:
        ranges = stage_ranges(loaded.path, loaded.num_layers, args.pp_size, args.pp_layers)
    except PartitionError as exc:
        raise CLIError(str(exc)) from None
    micro = getattr(args, "pp_micro_batch_size", DEFAULT_PP_MICRO_BATCH_SIZE)
    how = f"in process, prompt in {micro} micro-batches" if micro > 1 else "in process"
    print("pipeline: " + ", ".join(f"stage {i} layers {a}-{b - 1}" for i, (a, b) in enumerate(ranges))
          + f" ({how})", file=sys.stderr)
    return InProcessPipeline(loaded.model, ranges, micro_batches=micro)


def _run_tensor_parallel(args: argparse.Namespace, tp: Any, params: SamplingParams, text: str) -> int:
    """--tp-size N: this process is rank 0 of N (docs/tp.md); it prints, the others follow."""
    from mlxcel.parallel.generate import TPGeneration, timed

    if tp.rank > 0:
        raise CLIError(f"--tp-rank {tp.rank} is a follower rank: start it with mlxcel-server -m {args.model} "
                       f"--tp-size {tp.size} --tp-hostfile {args.tp_hostfile} --tp-rank {tp.rank}")
    with TPGeneration(tp, Path(args.model), tp_secret(args, tp)) as gen:
        print(describe_model(gen.loaded), file=sys.stderr)
        print(f"tensor parallel: {tp.plan.describe()}, {gen.backend} backend", file=sys.stderr)
        prompt = encode_prompt(args, gen.loaded.tokenizer, text)
        stats = GenerationStats(prompt_tokens=len(prompt))
        mx.reset_peak_memory()
        for event in timed(gen.stream(prompt, params), stats):
            sys.stdout.write(event.text)
            sys.stdout.flush()
        stats.peak_memory_gb = mx.get_peak_memory() / 1e9
    sys.stdout.write("\n")
    print(format_stats(stats), file=sys.stderr)
    return 0


def run_generate(args: argparse.Namespace) -> int:
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.seed, stop=tuple(args.stop),
    )
    text = _prompt_text(args)
    tp = prepare_tp(args, Path(args.model), check_checkpoint(args.model))  # refusals before any weight is read
    if tp is not None:
        return _run_tensor_parallel(args, tp, params, text)
    loaded = load_checkpoint(args.model)
    print(describe_model(loaded), file=sys.stderr)
    prompt = encode_prompt(args, loaded.tokenizer, text)
    model = _pipeline(args, loaded)
    stats = GenerationStats()
    prefill = model.prefill if isinstance(model, InProcessPipeline) and model.micro_batches > 1 else None
    for chunk in stream_generate(model, loaded.tokenizer, prompt, params, prefill=prefill, stats=stats):
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    print(format_stats(stats), file=sys.stderr)
    return 0
