"""The environment record every benchmark row carries: versions, host, CPU, date, git commit."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import socket
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any, Iterable

_PACKAGES = ("mlxcel", "mlx", "mlx-lm", "mlx-metal", "mlx-cpu", "mlx-cuda-13", "cryptography", "numpy", "fastapi", "uvicorn")


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    repo = Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.SubprocessError):
        return None
    commit = out.stdout.strip()
    if not commit:
        return None
    dirty = subprocess.run(
        ["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
        capture_output=True, text=True, timeout=5,
    ).stdout.strip()
    return commit + ("-dirty" if dirty else "")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _mlx_device() -> str | None:
    try:
        import mlx.core as mx
    except ImportError:
        return None
    return str(mx.default_device())


def environment() -> dict[str, Any]:
    """Describe where and with what a benchmark ran."""
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "mlx_device": _mlx_device(),
        "git_commit": _git_commit(),
        "versions": {name: v for name in _PACKAGES if (v := _version(name))},
    }


def write_jsonl(path: str | os.PathLike[str], rows: Iterable[dict[str, Any]]) -> Path:
    """Append rows to a JSONL file, each with the environment under "env"; returns the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    env = environment()
    with out.open("a", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps({**row, "env": env}, sort_keys=True) + "\n")
    return out
