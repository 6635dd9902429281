"""Command-line interface: argument parsing only; every command delegates to the library.

Each command module of ``mlxcel/commands/`` owns its parser: ``add_parser(subparsers)`` adds the
command, its flags and ``func`` (its ``run(args)``); ``build_parser`` is a loop over ``COMMANDS``.
Errors the user can fix print one line on stderr and exit non-zero; no tracebacks.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence

from mlxcel import __version__
from mlxcel.commands import convert, generate, models, node, plan, report, serve
from mlxcel.config import DEFAULT_MODEL_DIR, positive_int
from mlxcel.errors import CLIError

__all__ = ["CLIError", "COMMANDS", "DEFAULT_MODEL_DIR", "build_parser", "main", "positive_int", "server_main"]

EXIT_ERROR = 1
#: the subcommands, in ``mlxcel --help``'s order
COMMANDS = (generate, plan, convert, models, report, node, serve)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlxcel", description="LLM inference on MLX, on one host or several.")
    parser.add_argument("--version", action="version", version=f"mlxcel {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
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
    parser = argparse.ArgumentParser(prog="mlxcel-server", description="OpenAI-compatible server for mlxcel.")
    parser.add_argument("--version", action="version", version=f"mlxcel {__version__}")
    serve.add_server_arguments(parser)
    args = parser.parse_args(argv)
    return _run(serve.run, args)
