"""``mlxcel convert``: a GGUF file -> an MLX checkpoint directory (``mlxcel/models/gguf_import.py``)."""

from __future__ import annotations

import argparse
import sys


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """``mlxcel convert``."""
    c = subparsers.add_parser("convert", help="convert a GGUF file into an MLX checkpoint directory")
    c.add_argument("gguf", help="input .gguf file")
    c.add_argument("out_dir", help="output checkpoint directory")
    c.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "auto"], default=None,
                   help="dequantize to this dtype ('auto' = fastest for this device); default keeps quantized weights")
    c.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    c.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from mlxcel.models.gguf_import import convert_gguf

    out = convert_gguf(args.gguf, args.out_dir, dtype=args.dtype, overwrite=args.overwrite,
                       progress=lambda msg: print(msg, file=sys.stderr, flush=True))
    print(out)
    return 0
