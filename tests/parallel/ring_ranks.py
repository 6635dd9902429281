"""Run a module as ``size`` rank processes joined once by MLX's ring backend on 127.0.0.1 (test helper)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.ports import free_ports


def run_ranks(module: str, args: list[str], out: Path, size: int, timeout: float, tail: int = 3000) -> None:
    """``python -m module *args`` once per rank (``MLX_RANK``, ``MLX_WORLD_SIZE``, a hostfile in ``out``);
    waits for all of them and fails with their stderr's tails if any exits non-zero. Kills what is left."""
    hostfile = out / "ring.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(size)]))
    procs = []
    for rank in range(size):
        env = {**os.environ, "MLX_RANK": str(rank), "MLX_WORLD_SIZE": str(size), "MLX_HOSTFILE": str(hostfile)}
        procs.append(subprocess.Popen([sys.executable, "-m", module, *args], env=env, stderr=subprocess.PIPE,
                                      text=True))
    try:
        errors = [p.communicate(timeout=timeout)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert all(p.returncode == 0 for p in procs), "\n".join(e[-tail:] for e in errors)
