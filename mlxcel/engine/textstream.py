"""Per-sequence text assembly: streaming detokenization plus stop strings.

Any backend that yields token ids uses one ``SequenceText`` per request to turn
them into the text pieces an ``EventStream`` carries.
"""

from __future__ import annotations

from typing import Any

from mlxcel.engine.stops import StopMatcher


class SequenceText:
    """Feed generated tokens, get safe-to-emit text; ``stopped`` once a stop string matched."""

    def __init__(self, tokenizer: Any, stops: tuple[str, ...]):
        self._detok = tokenizer.detokenizer
        self._detok.reset()
        self._stops = StopMatcher(stops)

    @property
    def stopped(self) -> bool:
        return self._stops.stopped

    def feed(self, token: int) -> str:
        self._detok.add_token(token)
        return self._stops.feed(self._detok.last_segment)

    def finish(self) -> str:
        """Everything still held back (detokenizer tail, undecided stop prefix)."""
        if self._stops.stopped:
            return ""
        self._detok.finalize()
        return self._stops.feed(self._detok.last_segment) + self._stops.flush()
