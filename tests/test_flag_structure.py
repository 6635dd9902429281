"""Flags travel typed: past ``mlxcel/commands/`` (and ``mlxcel/cli.py``) no code reads ``getattr(args, ...)``
or takes an ``argparse.Namespace``; every command module owns its parser; ``build_parser`` is a loop."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import mlxcel
from mlxcel import cli

ROOT = Path(mlxcel.__file__).parent
ALLOWED = (ROOT / "commands", ROOT / "cli.py")


def _sources() -> list[Path]:
    return [p for p in ROOT.rglob("*.py") if not any(p == a or a in p.parents for a in ALLOWED)]


def _namespace_params(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
            for arg in args:
                if arg.annotation is not None and "Namespace" in ast.unparse(arg.annotation):
                    found.append(f"{node.name}({arg.arg})")
    return found


def test_no_untyped_flag_bag_past_the_commands():
    offenders = []
    for path in _sources():
        text = path.read_text()
        rel = path.relative_to(ROOT.parent)
        offenders += [f"{rel}: getattr(args" for _ in re.finditer(r"getattr\(args\b", text)]
        offenders += [f"{rel}: {name}" for name in _namespace_params(ast.parse(text))]
    assert offenders == []


def test_every_command_module_owns_its_parser():
    names = set()
    for module in cli.COMMANDS:
        assert callable(module.add_parser) and callable(module.run), module.__name__
        assert module.__name__.startswith("mlxcel.commands."), module.__name__
        names.add(module.__name__.rsplit(".", 1)[1])
    assert {"generate", "serve", "plan", "report", "models", "node", "convert"} <= names
    parser = cli.build_parser()
    commands = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert {"generate", "serve", "plan", "report", "models", "node", "convert"} <= set(commands)
    assert len(inspect.getsource(cli.build_parser).splitlines()) <= 12
