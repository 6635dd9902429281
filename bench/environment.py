"""The environment record every benchmark row carries: versions, host, machine, CPU, date, git commit."""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import platform
import re
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any, Iterable

_PACKAGES = ("mlxcel", "mlx", "mlx-lm", "mlx-metal", "mlx-cpu", "mlx-cuda-13", "cryptography", "numpy", "fastapi", "uvicorn")


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


COMMIT_ENV = "MLXCEL_GIT_COMMIT"
_COMMIT_RE = re.compile(r"^[0-9a-f]{7,40}(-dirty)?$")


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess[str] | None:
    try:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None


def _commit_from_checkout(repo: Path) -> str | None:
    """The checkout's commit (plus "-dirty"), or None outside a git checkout or before its first commit.

    ``git rev-parse HEAD`` prints "HEAD" (exit 128) in a repository without commits, so the exit
    status and the shape of the answer are both checked.
    """
    out = _git(repo, "rev-parse", "--verify", "--quiet", "HEAD^{commit}")
    commit = out.stdout.strip() if out is not None and out.returncode == 0 else ""
    if not re.fullmatch(r"[0-9a-f]{40}", commit):
        return None
    status = _git(repo, "status", "--porcelain", "--untracked-files=no")
    dirty = status is not None and status.returncode == 0 and bool(status.stdout.strip())
    return commit + ("-dirty" if dirty else "")


def _commit_from_package() -> str | None:
    """The commit pip recorded when mlxcel was installed from a git URL (direct_url.json), if any."""
    try:
        text = metadata.distribution("mlxcel").read_text("direct_url.json")
        commit = json.loads(text or "{}").get("vcs_info", {}).get("commit_id", "")
    except (metadata.PackageNotFoundError, ValueError, AttributeError):
        return None
    return commit if re.fullmatch(r"[0-9a-f]{40}", commit) else None


def git_commit(environ: dict[str, str] | None = None, repo: Path | None = None) -> str | None:
    """The commit these benchmarks run from: the git checkout, else $MLXCEL_GIT_COMMIT (set by the
    Ansible bench role on copies without .git), else pip's record of a git install; never "HEAD".

    Raises ValueError for a malformed $MLXCEL_GIT_COMMIT, so a typo never lands in the rows.
    """
    env = os.environ if environ is None else environ
    commit = _commit_from_checkout(repo or Path(__file__).resolve().parent.parent)
    if commit:
        return commit
    value = env.get(COMMIT_ENV, "").strip().lower()
    if value:
        if not _COMMIT_RE.fullmatch(value):
            raise ValueError(f"{COMMIT_ENV}={value!r} is not a git commit (7-40 hex digits, optional -dirty)")
        return value
    return _commit_from_package()


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


def _memory_gb() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return None


def _machine_id() -> str | None:
    """A short hash of /etc/machine-id: tells apart hosts that share a hostname, reveals nothing."""
    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        try:
            raw = Path(path).read_text().strip()
        except OSError:
            continue
        if raw:
            return hashlib.sha256(raw.encode()).hexdigest()[:12]
    return None


def _accelerator() -> str | None:
    """MLX's name for the device it computes on (a GPU model, or the CPU on mlx[cpu])."""
    try:
        import mlx.core as mx

        return str(mx.device_info().get("device_name") or "") or None
    except Exception:  # noqa: BLE001 - older MLX or no device: the record just lacks it
        return None


def machine() -> dict[str, Any]:
    """What tells one machine from another in the rows, beyond its hostname."""
    return {
        "arch": platform.machine(),
        "memory_gb": _memory_gb(),
        "machine_id": _machine_id(),
        "accelerator": _accelerator(),
    }


def _commit_or_problem() -> tuple[str | None, str | None]:
    """A bad $MLXCEL_GIT_COMMIT must not throw away a finished run's rows: recorded, and said on stderr."""
    try:
        return git_commit(), None
    except ValueError as exc:
        print(f"bench: warning: {exc}; rows record no commit", file=sys.stderr)
        return None, str(exc)


def environment() -> dict[str, Any]:
    """Describe where and with what a benchmark ran."""
    commit, problem = _commit_or_problem()
    env = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "mlx_device": _mlx_device(),
        "git_commit": commit,
        "machine": machine(),
        "versions": {name: v for name in _PACKAGES if (v := _version(name))},
    }
    if problem:
        env["git_commit_problem"] = problem
    return env


def load_1m() -> float | None:
    """The host's 1-minute load average (other jobs on a shared box, and this benchmark's own processes)."""
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


def write_jsonl(path: str | os.PathLike[str], rows: Iterable[dict[str, Any]]) -> Path:
    """Append rows to a JSONL file, each with the environment under "env"; returns the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    env = environment()
    with out.open("a", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps({**row, "env": env}, sort_keys=True) + "\n")
    return out
