"""The per-row logits processors hook: what changes a row's logits before its token is sampled.

Every place that samples a token (the single node and TP rank 0 through ``SliceRunner``, a pipeline's
last stage, the coordinator with ``--pp-return-logits``, a disaggregated prefill node for the first
token and the decode node after it) goes through ``mlxcel.engine.runner.sample_lazy``, which applies a
row's ``RowLogits`` to its last-position logits [1, V] first. The processors are mlx-lm's
(``mlx_lm.sample_utils.make_logits_processors``: logit_bias, then the repetition, presence and
frequency penalties), each ``(tokens, logits) -> logits``; then a grammar's token mask (constrained
decoding, ``mlxcel.engine.grammar.GrammarMask``, ``RowLogits.grammar``), so it works in every topology
(docs/engine.md).

The penalties look at the last ``PENALTY_CONTEXT`` tokens before the one being sampled, the prompt's
included (mlx-lm's ``generate_step`` and its server count them the same way). A row is built with
that window of its prompt (``context``), then every token it samples is appended, lazily (no device
read). A row that starts elsewhere gets the window from what it knows: a decode node the handoff's
prompt and first token, a pipeline's last stage PREPARE's ``params.context``, a resumed request its
re-prefilled ``prompt + generated`` - so a resume equals an uninterrupted run.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import mlx.core as mx
from mlx_lm.sample_utils import make_logits_processors

from mlxcel.engine.sampling import SamplingParams

LogitsProcessor = Callable[[mx.array, mx.array], mx.array]  # (tokens [T], logits [1, V]) -> logits [1, V]
PENALTY_CONTEXT = 20  # tokens the penalties look back over (mlx-lm's default context size)


def row_logits(params: SamplingParams, context: Sequence[int] = (), replay: Sequence[int] = (),
               vocab_size: int | None = None) -> RowLogits:
    """A row's processors for ``params``, seeing ``context`` (the tokens before its first sampled one); a
    grammar's mask last, its matcher advanced over ``replay`` (the tokens the request generated before).
    Raises ``GrammarError`` where the grammar does not compile or refuses ``replay``."""
    rows = RowLogits(processors_of(params), context if params.processed else (), [t for t, _ in params.logit_bias])
    if params.grammar is not None:
        from mlxcel.engine.grammar import GrammarMask

        rows.grammar = GrammarMask(params.grammar, replay, vocab_size)
    return rows


def processors_of(params: SamplingParams) -> list[LogitsProcessor]:
    """mlx-lm's processors for ``params`` (empty when none applies)."""
    if not params.processed:
        return []
    return make_logits_processors(
        logit_bias=dict(params.logit_bias) or None,
        repetition_penalty=params.repetition_penalty if params.repetition_penalty != 1.0 else None,
        repetition_context_size=PENALTY_CONTEXT,
        presence_penalty=params.presence_penalty or None,
        presence_context_size=PENALTY_CONTEXT,
        frequency_penalty=params.frequency_penalty or None,
        frequency_context_size=PENALTY_CONTEXT,
    )


def context_of(tokens: Sequence[int]) -> tuple[int, ...]:
    """The window of ``tokens`` (a prompt, or ``prompt + generated``) the penalties look at."""
    return tuple(tokens[-PENALTY_CONTEXT:]) if PENALTY_CONTEXT else ()


def replayed(params: SamplingParams, tokens: Sequence[int], draws: int) -> tuple[int, ...]:
    """What a grammar replays for a row whose ``tokens`` (``prompt + generated``) end with the ``draws``
    tokens it generated before (a resume, a handoff); empty without a grammar."""
    return tuple(tokens[len(tokens) - draws:]) if params.constrained and draws > 0 else ()


class RowLogits:
    """One row's processors and the window of tokens they see (a device array, grown lazily)."""

    def __init__(self, processors: list[LogitsProcessor], context: Sequence[int] = (), ids: Sequence[int] = ()):
        self.processors = processors
        window = context_of(context)
        self.history = mx.array(list(window), dtype=mx.int32)
        # the largest token id the processors index with (logit_bias, the window): checked against the logits'
        # width before the first use, since MLX does not bounds-check indices
        self.top_id = max((*window, *ids), default=-1)
        self.grammar: Any = None  # a GrammarMask, applied after the processors

    def __bool__(self) -> bool:
        return bool(self.processors) or self.grammar is not None

    def __call__(self, logits: mx.array) -> mx.array:
        """Row logits [1, V] after every processor, in order; ``IndexError`` where a token id is outside V."""
        if self.top_id >= logits.shape[-1]:
            raise IndexError(f"token id {self.top_id} is outside the model's vocabulary of {logits.shape[-1]}")
        for processor in self.processors:
            logits = processor(self.history, logits)
        return self.grammar(logits) if self.grammar is not None else logits

    def observe(self, token: mx.array) -> None:
        """Append the token just sampled ([1] or scalar, lazy) to the window."""
        if self.grammar is not None:
            self.grammar.observe(token)
        if self.processors:
            grown = mx.concatenate([self.history, token.reshape(1).astype(mx.int32)])
            self.history = grown[-PENALTY_CONTEXT:]
