"""``mlxcel generate``: stream a completion to the terminal, then one line of statistics.

``add_parser`` adds the command and its flags; ``run`` checks them once (native Windows, ``TPFlags.check``,
``check_pipeline_flags``) and generates. MLX and the engine are imported only when it runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlxcel import envs
from mlxcel.config import (DEFAULT_KV_GROUP_SIZE, DEFAULT_MAX_TOKENS, DEFAULT_MODEL_DIR, DEFAULT_PP_MICRO_BATCH_SIZE, DEFAULT_PP_SIZE,
                           MAX_PP_MICRO_BATCH_SIZE, check_micro_batch_size, positive_int)
from mlxcel.entrypoints.flags import add_kv_arguments, check_kv_flags
from mlxcel.errors import CLIError
from mlxcel.parallel.options import TPFlags

if TYPE_CHECKING:
    from mlxcel.engine.generate import GenerationStats
    from mlxcel.engine.sampling import SamplingParams


def _add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temp", "--temperature", dest="temperature", type=float, default=0.0,
                   help="sampling temperature; 0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0 = off)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (default 0 = off)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")


class _Given(argparse.Action):
    """Store the value and note that the flag was given (``<dest>_given``): --pp-layers alone names --pp-size."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        setattr(namespace, f"{self.dest}_given", True)


def _add_pipeline_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pp-size", type=positive_int, default=DEFAULT_PP_SIZE, action=_Given, metavar="N",
                   help=f"pipeline stages in this process (default: as many as --pp-layers names, else "
                        f"{DEFAULT_PP_SIZE} = no pipeline)")
    p.add_argument("--pp-layers", default=None, metavar="RANGES",
                   help="inclusive layer ranges per stage, e.g. 0-11,12-29 (default: split by parameter bytes)")
    p.add_argument("--pp-micro-batch-size", type=int, default=DEFAULT_PP_MICRO_BATCH_SIZE, metavar="M",
                   help=f"prefill the prompt in M chunks, pipelined: stage 0 runs chunk k+1 while stage 1 runs "
                        f"chunk k (1 to {MAX_PP_MICRO_BATCH_SIZE}; default {DEFAULT_PP_MICRO_BATCH_SIZE}; "
                        f"the same tokens; no effect without a pipeline)")
    p.add_argument("--cluster-secret-file", default=None, metavar="PATH",
                   help="file holding the cluster secret (else MLXCEL_CLUSTER_SECRET_FILE, MLXCEL_CLUSTER_SECRET)")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """``mlxcel generate``."""
    g = subparsers.add_parser("generate", help="generate text from a prompt, streaming to the terminal")
    g.add_argument("-m", "--model", default=DEFAULT_MODEL_DIR, help=f"checkpoint directory (default {DEFAULT_MODEL_DIR})")
    g.add_argument("-p", "--prompt", required=True, help="the prompt ('-' reads stdin)")
    g.add_argument("-n", "--max-tokens", type=positive_int, default=DEFAULT_MAX_TOKENS,
                   help=f"tokens to generate at most (default {DEFAULT_MAX_TOKENS})")
    g.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    g.add_argument("--system", default=None, help="system message for the chat template")
    _add_sampling_arguments(g)
    add_kv_arguments(g)
    _add_pipeline_arguments(g)
    TPFlags.add_arguments(g, server=False)
    g.set_defaults(func=run)


def check_pipeline_flags(args: argparse.Namespace) -> None:
    """Flag combinations of ``generate``'s pipeline flags; the model's layer count is checked once it loads.

    ``--pp-layers`` without ``--pp-size`` sets ``pp_size`` to the number of ranges."""
    from mlxcel.topology.partition import PartitionError, parse_range_text

    if args.pp_layers is not None:
        try:
            stages = len(parse_range_text(args.pp_layers))
        except PartitionError as exc:
            raise CLIError(str(exc)) from None
        if getattr(args, "pp_size_given", False) and stages != args.pp_size:
            raise CLIError(f"--pp-layers names {stages} stage{'s' if stages != 1 else ''} "
                           f"but --pp-size is {args.pp_size}")
        args.pp_size = stages
    micro_batch_size_flag(args.pp_micro_batch_size)


def micro_batch_size_flag(size: int | None) -> None:
    """``--pp-micro-batch-size`` of either binary: ``config.check_micro_batch_size``'s bound, as a ``CLIError``."""
    if size is None:
        return
    try:
        check_micro_batch_size(size)
    except ValueError as exc:
        raise CLIError(str(exc)) from None


def run(args: argparse.Namespace) -> int:
    """Check the flags once (native Windows first, before the model is resolved), then generate."""
    from mlxcel.commands.windows import GENERATE_FLAGS, check_native_windows

    check_native_windows(vars(args), GENERATE_FLAGS)  # before anything else, the model included
    envs.check()  # every MLXCEL_* variable, refused by name before any load
    tp = TPFlags.from_cli_args(vars(args))
    tp.check(pp_layers=args.pp_layers, pp_size=args.pp_size)
    check_pipeline_flags(args)
    check_kv_flags(args.kv_bits, args.kv_group_size)
    return run_generate(args, tp)


def _kv(args: argparse.Namespace) -> Any:
    """--kv-bits / --kv-group-size as a ``KVQuant`` (None: full precision)."""
    from mlxcel.engine.kv_quant import kv_quant

    return kv_quant(args.kv_bits, args.kv_group_size or DEFAULT_KV_GROUP_SIZE)


def _prompt_text(args: argparse.Namespace) -> str:
    from mlxcel.engine.prompts import PromptError

    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not text.strip():
        raise PromptError("prompt must not be empty")
    return text


def describe_model(loaded: Any) -> str:
    """The start-up line: name, family, layers, weights, device, BLAS."""
    import mlx.core as mx

    from mlxcel.blas import blas_in_use

    return (f"model: {loaded.name} ({loaded.model_type}, {loaded.num_layers} layers) | "
            f"weights: {loaded.describe_weights()} | device: {mx.default_device()} | blas: {blas_in_use()}")


def encode_prompt(args: argparse.Namespace, tokenizer: Any, text: str) -> list[int]:
    """``text`` as token ids: raw with --raw, else through the chat template (with --system)."""
    from mlxcel.engine.prompts import encode_chat, encode_raw

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
    from mlxcel.cluster.secret import load_secret
    from mlxcel.pipeline.inprocess import InProcessPipeline, stage_ranges
    from mlxcel.topology.partition import PartitionError

    if args.cluster_secret_file is not None:
        load_secret(args.cluster_secret_file)  # checked like the server does; in-process stages need no transport
    if args.pp_size < 2 and args.pp_layers is None:
        return loaded.model
    try:
        ranges = stage_ranges(loaded.path, loaded.num_layers, args.pp_size, args.pp_layers)
    except PartitionError as exc:
        raise CLIError(str(exc)) from None
    micro = args.pp_micro_batch_size
    how = f"in process, prompt in {micro} micro-batches" if micro > 1 else "in process"
    print("pipeline: " + ", ".join(f"stage {i} layers {a}-{b - 1}" for i, (a, b) in enumerate(ranges))
          + f" ({how})", file=sys.stderr)
    return InProcessPipeline(loaded.model, ranges, micro_batches=micro)


def _run_tensor_parallel(args: argparse.Namespace, tp: Any, params: SamplingParams, text: str,
                         secret: Any) -> int:
    """--tp-size N: this process is rank 0 of N (docs/tp.md); it prints, the others follow."""
    import mlx.core as mx

    from mlxcel.engine.generate import GenerationStats
    from mlxcel.parallel.generate import TPGeneration, timed

    with TPGeneration(tp, Path(args.model), secret, kv=_kv(args)) as gen:
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


def run_generate(args: argparse.Namespace, tp_flags: TPFlags) -> int:
    """Generate, the flags checked (``run``)."""
    from mlxcel.cluster.secret import load_secret
    from mlxcel.engine.generate import GenerationStats, stream_generate
    from mlxcel.engine.kv_quant import use_kv_bits
    from mlxcel.engine.sampling import SamplingParams
    from mlxcel.models.loading import check_checkpoint, load_checkpoint
    from mlxcel.parallel.options import prepare_tp
    from mlxcel.pipeline.inprocess import InProcessPipeline

    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.seed, stop=tuple(args.stop),
    )
    text = _prompt_text(args)
    tp = prepare_tp(tp_flags, Path(args.model), check_checkpoint(args.model))  # refusals before any weight is read
    if tp is not None:
        if tp.rank > 0:
            raise CLIError(f"--tp-rank {tp.rank} is a follower rank: start it with mlxcel-server -m {args.model} "
                           f"--tp-size {tp.size} --tp-hostfile {args.tp_hostfile} --tp-rank {tp.rank}")
        # the control channel's secret, once: with a hostfile the cluster secret (fail closed: it crosses hosts);
        # without one nothing is read (rank 0 makes a fresh secret per launch)
        secret = None if tp.local else load_secret(args.cluster_secret_file, required=True)
        return _run_tensor_parallel(args, tp, params, text, secret)
    loaded = load_checkpoint(args.model)
    use_kv_bits(loaded.model, _kv(args))
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
