"""gpt-oss's Harmony format at the front: forcing a call, reading channels and calls back from the text.

A Harmony answer is a run of messages ``<|start|>ROLE[ to=RECIPIENT]<|channel|>CHANNEL[ <|constrain|>json]
<|message|>BODY`` ended by ``<|end|>``, ``<|call|>`` or ``<|return|>``; the chat template renders the prompt
(tools as a TypeScript namespace in the developer message) and ends it with ``<|start|>assistant``. Bodies
go out by channel: ``analysis`` is reasoning, ``final`` and a recipient-less ``commentary`` are content, a
message to ``functions.NAME`` is a tool call whose body is its JSON arguments.

The reader works on the decoded text at the special tokens' strings, like ``reasoning.MarkerSplitter``, so it
is the same in every topology. (The ``openai-harmony`` package parses token ids of its own ``o200k_harmony``
encoding, whose vocabulary file it downloads at run time from outside the package registries; it can
neither load here nor read the token ids of other tokenizers.)
"""

from __future__ import annotations

import json
import re
from typing import Any, Optional

from mlxcel.server.reasoning import Piece, PieceSink, partial_suffix

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
#: a header longer than this without ``<|message|>`` is no header: the model left the format, it is content
MAX_HEADER = 256
#: the canonical header of a call message; a forced call prefills it (``tool_calls.FORCED_OPENINGS``)
CALL_HEAD = "<|channel|>commentary to={recipient} <|constrain|>json<|message|>"
FORCED_ANY = "<|channel|>commentary to=functions."  # tool_choice "required" among several tools
FINAL = "<|channel|>final<|message|>"  # a structured answer (response_format) is the final channel's body

_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)")
_CALL = re.compile(r"\bto=functions\.([^\s<]+)[^<]*(?:<\|constrain\|>[^<]*)?<\|message\|>(.*)\Z", re.DOTALL)


def is_harmony(tokenizer: Any) -> bool:
    """The checkpoint's chat template speaks Harmony (gpt-oss): it writes channels."""
    return CHANNEL in str(getattr(tokenizer, "chat_template", "") or "")


def forced_prefill(name: Optional[str]) -> str:
    """What follows the template's ``<|start|>assistant`` to force a call (to ``name``, or to any function)."""
    return CALL_HEAD.format(recipient=f"functions.{name}") if name else FORCED_ANY


def opened_tail(prompt_text: str) -> str:
    """The prompt's last message as far as it goes (after its last ``<|start|>``): where the answer begins."""
    at = prompt_text.rfind(START)
    return "" if at < 0 else prompt_text[at + len(START):]


def parse_tool_call(text: str, tools: Optional[list] = None) -> dict:
    """One call message (header ``to=functions.NAME ... <|message|>`` and JSON body) -> ``{name, arguments}``."""
    match = _CALL.search(text)
    if match is None:
        raise ValueError("not a Harmony message to a function")
    arguments = json.loads(match.group(2).strip())
    if not isinstance(arguments, dict):
        raise ValueError("Harmony call arguments are not a JSON object")
    return {"name": match.group(1), "arguments": arguments}


class HarmonySplitter(PieceSink):
    """Feed text pieces, get ``(kind, text)`` pieces: reasoning, content and whole call messages.

    ``opened`` is the prompt's open last message (``opened_tail``): a header being written, or a body
    already begun (a forced call). The prompt's own text is never given back. With ``calls`` false, a
    message to a recipient is content.
    """

    def __init__(self, opened: str = "", calls: bool = True):
        self._calls = calls
        self._state, self._header, self._held, self._call = "header", "", "", ""
        self._given = 0  # how much of the header is the prompt's own text, never given back
        if MESSAGE in opened:
            header, _, body = opened.partition(MESSAGE)
            self._open(header)
            self._held = body
        else:
            self._header, self._given = opened, len(opened)

    @property
    def state(self) -> str:
        return self._state

    def feed(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        self._held += text
        while self._step(out):
            pass
        keep = partial_suffix(self._held, self._markers())
        if self._state == "header":
            self._header += self._held[:len(self._held) - keep]
            if len(self._header) > MAX_HEADER:
                self._overflow(out)
        else:
            self._emit(self._held[:len(self._held) - keep], out)
        self._held = self._held[len(self._held) - keep:]
        return out

    def finish(self) -> list[Piece]:
        """Everything held back; an unterminated call is delivered as a call, a dangling header as content."""
        out: list[Piece] = []
        if self._state == "header":
            self._header += self._held
            self._emit_stray(out)
        else:
            self._emit(self._held, out)
            self._close(out)
        self._held = ""
        return out

    def _markers(self) -> tuple[str, ...]:
        return (START, MESSAGE, *ENDS) if self._state == "header" else (START, *ENDS)

    def _step(self, out: list[Piece]) -> bool:
        """Act on the first marker in the held text; False when there is none."""
        hits = [(self._held.find(m), m) for m in self._markers() if m in self._held]
        if not hits:
            return False
        at, marker = min(hits)
        before, self._held = self._held[:at], self._held[at + len(marker):]
        if self._state == "header":
            self._header += before
            if len(self._header) > MAX_HEADER:  # as if it had come piece by piece: content before the marker
                self._held = marker + self._held
                self._overflow(out)
            elif marker == MESSAGE:
                self._open(self._header)
            else:
                self._emit_stray(out)
            return True
        self._emit(before, out)
        self._close(out)
        return True

    def _open(self, header: str) -> None:
        """A header is complete: the body goes where its channel and recipient say."""
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        self._header, self._given = "", 0
        if recipient and self._calls and recipient.group(1) != "assistant":
            self._state, self._call = "tool", CALL_HEAD.format(recipient=recipient.group(1))
        elif channel and channel.group(1) == "analysis":
            self._state = "reasoning"
        else:
            self._state = "content"

    def _overflow(self, out: list[Piece]) -> None:
        """A header longer than ``MAX_HEADER`` is none: the model left the format, its text is content."""
        self._state, text, self._header, self._given = "content", self._header[self._given:], "", 0
        self._emit(text, out)

    def _close(self, out: list[Piece]) -> None:
        """A message ended: a call is delivered whole; the next header begins."""
        if self._state == "tool":
            out.append(("call", self._call))
        self._state, self._call, self._header = "header", "", ""

    def _emit_stray(self, out: list[Piece]) -> None:
        """Header text that led to no message: kept as content unless it is only a role or whitespace."""
        stray, self._header, self._given = self._header[self._given:], "", 0
        if stray.strip() and stray.strip() != "assistant":
            out.append(("content", stray))

