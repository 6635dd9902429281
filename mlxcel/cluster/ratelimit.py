"""Rate-limited cluster warnings in four classes (reference, "Handshake failures").

Each class logs at most 5 warnings per 60 s window; the rest go to debug.  The first
warning of a class after a window that suppressed lines is preceded by the summary
"N cluster warnings (<class>) were logged at debug during the 60s window that ended
Ms ago", written when that next event arrives (so M can exceed 60).
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

WARNINGS_PER_WINDOW = 5
WINDOW_S = 60.0


class WarnClass(str, enum.Enum):
    """The four classes; one budget each, so junk cannot mute typed refusals."""

    NOISE = "noise"  # bad magic, malformed hello, stall to the timeout, pending-pool refusal
    DIAGNOSTIC = "diagnostic"  # secret mismatch, identity, suite, frame auth failure, unknown kind
    ROUTER_DROP = "router-drop"  # result frame from a sender that is not a configured peer
    AT_CAPACITY = "at-capacity"  # a capacity refusal the connection pool is retrying


@dataclass
class _Window:
    start: float
    logged: int = 0
    suppressed: int = 0


class RateLimitedLog:
    """Per-class budgets over one logger; thread-safe; the clock is injectable."""

    def __init__(
        self,
        logger: logging.Logger,
        *,
        clock: Callable[[], float] = time.monotonic,
        per_window: int = WARNINGS_PER_WINDOW,
        window_s: float = WINDOW_S,
    ) -> None:
        self.logger = logger
        self._clock = clock
        self._per_window = per_window
        self._window_s = window_s
        self._windows: dict[WarnClass, _Window] = {}
        self._lock = threading.Lock()

    def warning(self, cls: WarnClass, msg: str, *args: object) -> bool:
        """Log at warning within budget, else at debug; returns whether it was a warning."""
        cls = WarnClass(cls)
        with self._lock:
            summary, as_warning = self._account(cls, self._clock())
        if summary is not None:
            self.logger.warning(summary)
        self.logger.log(logging.WARNING if as_warning else logging.DEBUG, msg, *args)
        return as_warning

    def _account(self, cls: WarnClass, now: float) -> tuple[str | None, bool]:
        w = self._windows.get(cls)
        summary = None
        if w is None or now - w.start >= self._window_s:
            if w is not None and w.suppressed:
                ended_ago = now - (w.start + self._window_s)
                summary = (
                    f"{w.suppressed} cluster warnings ({cls.value}) were logged at debug during the "
                    f"{self._window_s:.0f}s window that ended {ended_ago:.0f}s ago"
                )
            w = self._windows[cls] = _Window(start=now)
        if w.logged < self._per_window:
            w.logged += 1
            return summary, True
        w.suppressed += 1
        return summary, False


log = logging.getLogger("mlxcel.cluster")
#: the process-wide limiter every cluster component logs through
cluster_warnings = RateLimitedLog(log)
