"""One process hosting several stage, prefill or decode nodes: ``python -m tests.node_host SPEC``.

``SPEC`` is a JSON file holding a list of ``mlxcel-server`` command lines (without the program name),
one per node. Each goes through what ``mlxcel-server`` does with it up to the socket: the same flag
parser, ``serve_config`` (the checks, the checkpoint, the cluster TOML and its secret, the role's own
``configure`` hook), then the role's own loading process (``StageProcess`` of ``mlxcel.entrypoints.stage``,
``WorkerProcess`` of ``mlxcel.entrypoints.disagg_node``), which loads the node and starts its service on the
cluster address. What it leaves out is the process plumbing that does not depend on the model: the
``/health`` HTTP port, signals and the exit code (``mlxcel.loading_process.serve_loading``). It prints
``ready N`` once every node serves (else ``failed: ...`` and exits 1) and serves until its stdin
closes. The family tables use it so that the nodes of every family run in a few processes instead of
a few per family; their representative rows run the real ``mlxcel-server`` processes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Iterator

START_S = 400.0  # a host loads every family's nodes (a loaded 2-core box is slow)


def server_args(argv: list[str]) -> argparse.Namespace:
    """``argv`` parsed by ``mlxcel-server``'s own flag parser."""
    from mlxcel.commands.serve import add_server_arguments

    parser = argparse.ArgumentParser(prog="mlxcel-server")
    add_server_arguments(parser)
    return parser.parse_args(argv)


def load_node(argv: list[str], failures: list[str]) -> Any:
    """The role's loading process for one ``mlxcel-server`` command line, loaded (or failed into ``failures``)."""
    from mlxcel.commands.serve import serve_config

    config = serve_config(server_args(argv))
    if config.role == "stage":
        from mlxcel.entrypoints.stage import StageProcess

        assert config.dist is not None
        process: Any = StageProcess(config.dist, config.server.model, config.secret)
        process.load(failures.append, lambda: None)
    elif config.role in ("prefill", "decode"):
        from mlxcel.entrypoints.disagg_node import WorkerProcess

        assert config.disagg is not None
        assert config.secret is not None  # every disaggregated node loads it (fail closed)
        process = WorkerProcess(config.server, config.disagg, config.secret)
        process.load(failures.append)
    else:
        raise SystemExit(f"a node host serves stage, prefill and decode nodes, not {config.role}")
    return process


def serve(command_lines: list[list[str]]) -> int:
    import mlxcel  # noqa: F401  (OpenBLAS first)

    processes, failures = [], []
    try:
        for argv in command_lines:
            processes.append(load_node(argv, failures))
            if failures:
                print(f"failed: {failures[0]}", flush=True)
                return 1
        print(f"ready {len(processes)}", flush=True)
        sys.stdin.read()
        return 0
    finally:
        for process in processes:
            process.close()


def first_line(proc: subprocess.Popen, timeout: float) -> str:
    """The first line the process prints on stdout, or "" if none comes within ``timeout``."""
    got: list[str] = []
    assert proc.stdout is not None
    reader = threading.Thread(target=lambda: got.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    return got[0].strip() if got else ""


def stop(proc: subprocess.Popen) -> None:
    """Close its stdin (the host's signal to stop), then kill it if it does not exit."""
    if proc.poll() is None:
        try:
            proc.stdin.close()  # type: ignore[union-attr]
            proc.wait(20)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait(10)


@contextlib.contextmanager
def node_hosts(tmp: Path, groups: list[list[list[str]]]) -> Iterator[None]:
    """One host process per group of ``mlxcel-server`` command lines, all started at once; returns once
    every host serves all its nodes, stops them on exit."""
    hosts = []
    try:
        for i, group in enumerate(groups):
            spec = tmp / f"node-host-{i}.json"
            spec.write_text(json.dumps(group))
            hosts.append(subprocess.Popen([sys.executable, "-m", "tests.node_host", str(spec)], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, text=True))
        for host, group in zip(hosts, groups):
            line = first_line(host, START_S)
            assert line == f"ready {len(group)}", f"a node host did not start: {line!r}"
        yield
    finally:
        for host in hosts:
            stop(host)


if __name__ == "__main__":
    sys.exit(serve(json.loads(Path(sys.argv[1]).read_text())))
