"""Split generated text at the template's markers: reasoning (think markers) and tool-call text.

The markers are those mlx-lm's ``TokenizerWrapper`` finds (``think_start``/``think_end`` from the vocabulary,
``tool_call_start``/``tool_call_end`` from the tool parser it infers from the chat template). Splitting works
on text, so it is the same whichever topology generated the tokens; a suffix that could still become a marker
is held back until the next piece decides it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Literal, Optional

Kind = Literal["content", "reasoning", "call"]
Piece = tuple[Kind, str]  # ("call", text) is one whole tool call's text between its markers


@dataclass(frozen=True)
class Markers:
    """The marker pairs that are active for one request (None: that kind is not split out)."""

    think: Optional[tuple[str, str]] = None
    tool: Optional[tuple[str, str]] = None


def think_markers(tokenizer: Any) -> Optional[tuple[str, str]]:
    """The (start, end) think markers mlx-lm found for this tokenizer, or None."""
    start, end = getattr(tokenizer, "think_start", None), getattr(tokenizer, "think_end", None)
    return (start, end) if start and end else None


def opens_in_reasoning(prompt_text: str, think: Optional[tuple[str, str]]) -> bool:
    """True when the rendered prompt ends inside an open think block (the template opened it)."""
    return bool(think) and prompt_text.rfind(think[0]) > prompt_text.rfind(think[1])


class PieceSink:
    """What the splitters share: text in state ``tool`` goes to the call being read, other text out as a
    reasoning or content piece."""

    _state: str
    _call: str

    def _emit(self, text: str, out: list[Piece]) -> None:
        if not text:
            return
        if self._state == "tool":
            self._call += text
        else:
            out.append(("reasoning" if self._state == "reasoning" else "content", text))


class MarkerSplitter(PieceSink):
    """Feed text pieces, get ``(kind, text)`` pieces: content, reasoning, and whole tool-call texts."""

    def __init__(self, markers: Markers, state: str = "content", call_prefix: str = ""):
        self._markers = markers
        self._state = state  # "content" | "reasoning" | "tool"
        self._held = ""
        self._call = call_prefix

    @property
    def state(self) -> str:
        return self._state

    def _active(self) -> dict[str, str]:
        """Marker text -> the state it leads to, for the current state."""
        think, tool = self._markers.think, self._markers.tool
        if self._state == "reasoning":
            return {think[1]: "content"} if think else {}
        if self._state == "tool":
            return {tool[1]: "content"} if tool else {}
        found = {think[0]: "reasoning"} if think else {}
        if tool:
            found[tool[0]] = "tool"
        return found

    def feed(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        self._held += text
        while True:
            active = self._active()
            hits = [(self._held.find(m), m) for m in active if m in self._held]
            if not hits:
                break
            at, marker = min(hits)
            self._emit(self._held[:at], out)
            self._held = self._held[at + len(marker):]
            self._switch(active[marker], out)
        keep = partial_suffix(self._held, self._active())
        self._emit(self._held[:len(self._held) - keep], out)
        self._held = self._held[len(self._held) - keep:]
        return out

    def finish(self) -> list[Piece]:
        """Everything held back; an unterminated tool call is delivered as a call (as mlx-lm's server does)."""
        out: list[Piece] = []
        self._emit(self._held, out)
        self._held = ""
        if self._state == "tool" and self._call.strip():
            out.append(("call", self._call))
        self._call = ""
        return out

    def _switch(self, state: str, out: list[Piece]) -> None:
        if self._state == "tool":
            out.append(("call", self._call))
            self._call = ""
        self._state = state


def partial_suffix(text: str, markers: Iterable[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a marker."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best
