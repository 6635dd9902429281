"""What a request's client hears: its tokens and its end, on the scheduler thread or the emitter's.

Token emission for the scheduler (``mlxcel.engine.scheduler``): EOS (not part of the output unless
``ignore_eos``), text and stop strings (``SequenceText``), ``max_tokens``, logprobs. A sequence with stop
strings is detokenized here, on the scheduler thread, since its text decides whether it goes on; with
asynchronous scheduling every other one is detokenized and delivered on the emitter thread
(``mlxcel.engine.emitter``): this pass's events wait in ``outbox`` and go out as one batch (``flush``).
"""

from __future__ import annotations

from typing import Callable

from mlxcel.engine import steptrace
from mlxcel.engine.emitter import Emitter, FinishOut, TokenOut
from mlxcel.engine.interface import FinishEvent, TokenEvent
from mlxcel.engine.requests import RequestTable, Seq
from mlxcel.engine.runner import Sampled
from mlxcel.engine.sampling import SamplingParams
from mlxcel.error_codes import ErrorCode


class Outputs:
    """Sends each sequence's tokens and its ``FinishEvent``; counts the tokens generated."""

    def __init__(self, table: RequestTable, eos: set[int], emitter: Emitter | None):
        self.table = table
        self.eos = eos
        self.emitter = emitter
        self.outbox: list[TokenOut | FinishOut] = []  # this pass's events for the emitter, sent as one batch

    def offthread(self, params: SamplingParams) -> bool:
        """Whether a request's text is made on the emitter thread: there is one and no stop string to decide."""
        return self.emitter is not None and not params.stop

    def token(self, seq: Seq, sampled: Sampled) -> str | None:
        """Send one token; the reason it ends ``seq`` ("stop": EOS or a stop string; "length"), else None."""
        req = seq.request
        token = sampled.token
        if token in self.eos and not req.ignore_eos:  # EOS is not part of the output
            return "stop"
        seq.generated.append(token)
        self.table.counters.generated_tokens += 1
        logprob, top = (sampled.logprob, sampled.top_logprobs) if req.params.logprobs else (None, ())
        if seq.offthread:  # EOS and max_tokens need no text: the emitter thread makes it
            self.outbox.append(TokenOut(seq.stream, seq.text, token, logprob, top))
        else:
            with steptrace.phase("detok"):
                text = seq.text.feed(token)
            with steptrace.phase("emit"):
                seq.stream.push(TokenEvent(token, text, logprob, top))
            if seq.text.stopped:
                return "stop"
        return "length" if len(seq.generated) >= req.params.max_tokens else None

    def finish(self, seq: Seq, reason: str, error: str | None, code: ErrorCode | None,
               forget: Callable[[], None]) -> None:
        """Send ``seq``'s end; ``forget`` frees it first (the slot is free before the client hears: no spurious
        503), after its text's tail was read on this thread (the emitter reads it after the tokens it has yet
        to detokenize)."""
        code = (code or ErrorCode.INTERNAL) if error is not None else None
        if seq.offthread:
            forget()
            self.outbox.append(FinishOut(seq.stream, seq.text, FinishEvent(
                reason, "", len(seq.request.prompt), len(seq.generated), error, code)))
            return
        with steptrace.phase("detok"):
            tail = seq.text.finish() if error is None else ""
        forget()
        with steptrace.phase("emit"):
            seq.stream.push(FinishEvent(reason, tail, len(seq.request.prompt), len(seq.generated), error, code))

    def flush(self) -> None:
        """Hand this pass's events to the emitter thread."""
        if self.outbox:
            assert self.emitter is not None
            with steptrace.phase("emit"):
                self.emitter.send(self.outbox)
            self.outbox = []

    def close(self) -> None:
        if self.emitter is not None:
            self.emitter.close()
