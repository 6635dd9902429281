"""Detokenization and streaming off the scheduler thread (asynchronous scheduling).

The scheduler decides a sequence's end from token ids alone where it can (EOS, ``max_tokens``, a cancel):
for a sequence without stop strings the text is not needed to go on, so turning ids into text
(``SequenceText``) and handing events to the HTTP side need not wait on the thread that feeds the device.
The scheduler queues each step's tokens and finishes as one batch (``Emitter.send``); the emitter thread
detokenizes them in order and delivers the events with one ``call_soon_threadsafe`` per event loop and
batch (``deliver``), instead of one wake-up of the loop per token. A sequence's events keep their order:
one queue, one thread. Sequences with stop strings stay on the scheduler thread (their text decides
whether they go on).
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any

from mlxcel.engine import steptrace
from mlxcel.engine.interface import Event, FinishEvent, TokenEvent

log = logging.getLogger("mlxcel.engine")


@dataclass(frozen=True)
class TokenOut:
    """A token for the emitter: ``text`` (a ``SequenceText``) turns it into the event's text."""

    stream: Any
    text: Any
    token: int
    logprob: float | None
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class FinishOut:
    """A finish for the emitter: the text's tail is read there (after the tokens before it)."""

    stream: Any
    text: Any
    event: FinishEvent  # its ``text`` is filled with the tail, unless ``error``


def deliver(pairs: list[tuple[Any, Event]]) -> None:
    """Push events to their streams: one ``call_soon_threadsafe`` per event loop for the whole list
    (an ``EventStream``'s loop), ``push`` for anything else (a warmup sink)."""
    by_loop: dict[Any, list[tuple[Any, Event]]] = {}
    for stream, event in pairs:
        loop = getattr(stream, "_loop", None)
        if loop is None:
            stream.push(event)
        else:
            by_loop.setdefault(loop, []).append((stream, event))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # the event loop is closed: nobody listens
            pass


def _put_all(items: list[tuple[Any, Event]]) -> None:
    for stream, event in items:
        stream._queue.put_nowait(event)  # noqa: SLF001 - EventStream's own queue, on its loop


class Emitter:
    """One thread that detokenizes and delivers the batches the scheduler sends, in order."""

    def __init__(self) -> None:
        self._inbox: queue.SimpleQueue[list[TokenOut | FinishOut] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="mlxcel-emitter", daemon=True)
        self._thread.start()

    def send(self, batch: list[TokenOut | FinishOut]) -> None:
        if batch:
            self._inbox.put(batch)

    def close(self, timeout: float = 10.0) -> None:
        """Deliver what was sent, then stop."""
        self._inbox.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while (batch := self._inbox.get()) is not None:
            try:
                self._emit(batch)
            except Exception:  # noqa: BLE001 - one bad batch must not end the streams after it
                log.exception("emitter: could not deliver a batch")

    @staticmethod
    def _emit(batch: list[TokenOut | FinishOut]) -> None:
        with steptrace.phase("off_detok"):
            pairs: list[tuple[Any, Event]] = []
            for out in batch:
                if isinstance(out, TokenOut):
                    pairs.append((out.stream, TokenEvent(out.token, out.text.feed(out.token), out.logprob, out.top)))
                else:
                    event = out.event
                    if event.error is None:
                        event = FinishEvent(event.finish_reason, out.text.finish(), event.prompt_tokens,
                                            event.completion_tokens, None, None)
                    pairs.append((out.stream, event))
        with steptrace.phase("off_emit"):
            deliver(pairs)

