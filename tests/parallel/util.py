"""Helpers: real ``mlxcel serve --tp-size N`` subprocesses and their follower ranks."""

from __future__ import annotations

import time
from pathlib import Path


def children(pid: int) -> list[int]:
    """PIDs of ``pid``'s direct children (Linux /proc)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def followers(pid: int, n: int, timeout: float = 60) -> dict[int, int]:
    """rank -> PID of the ``n`` local followers rank 0 (``pid``) started."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = {}
        for child in children(pid):
            args = cmdline(child).split()
            if "mlxcel.parallel.follower" in args:
                found[int(args[args.index("--rank") + 1])] = child
        if len(found) == n:
            return found
        time.sleep(0.05)
    raise AssertionError(f"rank 0 (pid {pid}) did not start {n} followers")


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_gone(pids, timeout: float) -> float:
    """Seconds until every pid exited; AssertionError after ``timeout``."""
    start = time.monotonic()
    while any(alive(p) for p in pids):
        if time.monotonic() - start > timeout:
            raise AssertionError(f"still running after {timeout}s: {[p for p in pids if alive(p)]}")
        time.sleep(0.05)
    return time.monotonic() - start
