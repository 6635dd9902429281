"""Waiting in tests for something another thread or process does after our side has returned."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(pred: Callable[[], bool], timeout: float = 5.0, every: float = 0.005) -> bool:
    """Whether ``pred()`` holds within ``timeout`` seconds (polled every ``every`` seconds)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(every)
    return pred()
