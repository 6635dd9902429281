"""Keep freed heap memory resident in a decode node, so each handoff's tensor buffers reuse faulted-in pages.

A handoff of 172 MB lands in about 56 fresh tensor buffers of a few MB. glibc gives each buffer above its
mmap threshold (128 KiB at first) its own mapping and unmaps it when freed, and trims the heap's free top
above its trim threshold, so the next handoff's buffers are fresh pages again: the kernel faults in and
zeroes every 4 KiB page on its first write. That per-byte work, not the copy, was the receiver's decode
stage: 0.5-1.3 GiB/s cold against about 6 GiB/s on warm pages on the 2-core CPU box (the copy alone runs
at 10 GiB/s). ``keep_freed_memory`` raises both thresholds once per process (``mallopt``): buffers up to
32 MiB (glibc's largest mmap threshold: a tensor of a 20,000-token qwen3-0.6b prompt) come from the heap,
and up to 1 GiB of freed heap stays resident for the next handoff instead of going back to the system.
Elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys
import threading

log = logging.getLogger("mlxcel.disagg.heap")

#: glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
#: freed heap kept resident (bytes; mallopt takes an int)
KEEP_BYTES = 1 << 30
#: the largest buffer served from the heap: glibc's largest mmap threshold on 64-bit hosts
HEAP_BUFFER_MAX = 32 << 20

_lock = threading.Lock()
_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Raise glibc's trim and mmap thresholds once per process; whether they are raised (False: not glibc,
    or glibc refused)."""
    global _applied
    with _lock:
        if _applied is None:
            _applied = _mallopt()
        return _applied


def _mallopt() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = bool(mallopt(M_MMAP_THRESHOLD, HEAP_BUFFER_MAX)) and bool(mallopt(M_TRIM_THRESHOLD, KEEP_BYTES))
    if not ok:
        log.info("heap: glibc refused the handoff buffers' malloc thresholds; freed buffers go back to the system")
    return ok
