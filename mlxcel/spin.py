"""Waiting by polling for a short window before sleeping (``MLXCEL_SPIN_US``; docs/pipeline.md §3.14).

A thread that sleeps in ``recv`` or ``queue.get`` between the steps of a pipeline wakes up late and, on the
hosts measured, runs its next step slower: a two-process ping-pong of two half models on one GPU took 5.9 ms a
token with sleeping receivers against 4.5 ms with polling ones (docs/benchmarks.md, 2026-12-07). With a window
set, a cluster connection's reader first polls its socket (``MSG_DONTWAIT``), a stage's worker its queue, and
the server's scheduler its inbox while a step is out (a coordinator waiting for its stages), each for up to the
window after it runs dry, then sleeps as before. Each poll releases the GIL.
Off by default: polling burns a core per waiting thread for the window after every message.
"""

from __future__ import annotations

import queue
import socket
import time
from typing import Any

from mlxcel.config import env_number

SPIN_ENV = "MLXCEL_SPIN_US"
MAX_SPIN_US = 100_000  # a tenth of a second: beyond it a poll costs more than any wake-up it saves


def spin_window_s() -> float:
    """The window in seconds: ``MLXCEL_SPIN_US`` microseconds (0 to 100000; unset: 0, off). ValueError naming the
    variable for anything else."""
    value = env_number(SPIN_ENV, int, 0, MAX_SPIN_US, "a whole number of microseconds")
    return (value or 0) / 1e6


def poll_recv_into(sock: socket.socket, view: memoryview, window_s: float) -> int | None:
    """Bytes received into ``view`` by polling the (blocking-mode) socket for up to ``window_s``: their count,
    0 at EOF, or None when nothing came in the window. OSErrors other than "nothing yet" propagate."""
    deadline = time.perf_counter() + window_s
    recv_into, flags, n = sock.recv_into, socket.MSG_DONTWAIT, len(view)
    while True:
        try:
            return recv_into(view, n, flags)
        except (BlockingIOError, InterruptedError):
            if time.perf_counter() >= deadline:
                return None


def poll_get(q: queue.SimpleQueue, window_s: float, timeout: float | None = None) -> Any:
    """The next item of ``q``: polled for up to ``window_s`` (sleeping 0 s between polls, which lets other threads
    take the GIL), then waited for (up to ``timeout`` seconds more: ``queue.Empty`` after it)."""
    if window_s > 0:
        deadline = time.perf_counter() + window_s
        get_nowait, sleep, clock = q.get_nowait, time.sleep, time.perf_counter
        while clock() < deadline:
            try:
                return get_nowait()
            except queue.Empty:
                sleep(0)
    return q.get(timeout=timeout)
