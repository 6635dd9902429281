"""Stop strings over streamed text: emit what is safe, hold back a possible prefix."""

from __future__ import annotations


class StopMatcher:
    """Feed decoded text pieces; get back the text to emit and whether a stop string was hit.

    Text that could be the beginning of a stop string is held back until the
    next piece decides it, so a client never sees part of a stop string.
    """

    def __init__(self, stops: tuple[str, ...] | list[str]):
        self.stops = tuple(stops)
        self._pending = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        if self.stopped:
            return ""
        if not self.stops:
            return text
        buf = self._pending + text
        cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._pending = ""
            return buf[:cut]
        hold = self._longest_partial(buf)
        self._pending = buf[len(buf) - hold:] if hold else ""
        return buf[: len(buf) - hold]

    def flush(self) -> str:
        """Text still held back when generation ends for another reason."""
        out, self._pending = self._pending, ""
        return "" if self.stopped else out

    def _longest_partial(self, buf: str) -> int:
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(buf)), best, -1):
                if buf.endswith(stop[:n]):
                    best = n
                    break
        return best
