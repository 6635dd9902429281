"""``mlxcel ARGS`` run by ``mlxcel.cli.main`` in the test's own process: the exit status and what it writes on
stdout and stderr, as ``subprocess.run`` would return them, without a fresh interpreter's 2-3 s of imports
(mlx-lm, transformers). For commands that need no process of their own: a tensor-parallel rank, a server and
anything that installs signal handlers or exits the interpreter still run as subprocesses."""

from __future__ import annotations

import contextlib
import io
import subprocess

from mlxcel.cli import main


def run_mlxcel(*args: str) -> subprocess.CompletedProcess:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse's usage errors (exit 2)
            code = exc.code if isinstance(exc.code, int) else 1
    return subprocess.CompletedProcess(["mlxcel", *args], code, out.getvalue(), err.getvalue())
