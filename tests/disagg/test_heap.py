"""The decode node keeps freed heap memory (``mlxcel/disagg/heap.py``), so a handoff's tensor buffers land on
pages already faulted in instead of fresh ones (docs/disagg.md §4.3)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.proc

# 8 buffers of 16 MiB made and freed in a fresh interpreter; prints the resident MiB it gave back
_PROBE = """
import sys, numpy as np
if sys.argv[1] == "keep":
    from mlxcel.disagg.heap import keep_freed_memory
    assert keep_freed_memory() is True
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 >> 20
bufs = [np.ones(16 << 20, np.uint8) for _ in range(8)]
before = rss()
del bufs
print(before - rss())
"""


def _given_back(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, timeout=60, check=True)
    return int(out.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and /proc")
def test_freed_buffers_stay_resident_once_kept() -> None:
    assert _given_back("plain") >= 100  # glibc's default: each 16 MiB buffer is its own mapping, unmapped when freed
    assert _given_back("keep") < 16  # kept: they came from the heap and stay there, faulted in, for the next handoff


def test_keep_freed_memory_is_idempotent() -> None:
    from mlxcel.disagg.heap import keep_freed_memory

    assert keep_freed_memory() == keep_freed_memory()
