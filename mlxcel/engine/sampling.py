"""Sampling parameters and samplers: greedy, temperature, top-p, min-p, top-k, per-request seed; the
parameters of the logits processors (penalties, logit_bias) that ``mlxcel.engine.logits`` builds."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from mlxcel.config import DEFAULT_MAX_TOKENS, MAX_STOP_STRINGS, MAX_TOKENS_LIMIT
from mlxcel.engine.grammar import GrammarError, check_text

MAX_LOGIT_BIAS = 300  # most logit_bias entries per request (OpenAI's bound)
LOGIT_BIAS_LIMIT = 100.0  # a bias is in [-100, 100]
PENALTY_LIMIT = 2.0  # presence and frequency penalties are in [-2, 2] (OpenAI's bound)
MAX_REPETITION_PENALTY = 10.0  # repetition_penalty is in (0, 10]; 1 is off

Sampler = Callable[[mx.array], mx.array]


class SamplingError(ValueError):
    """A sampling parameter is out of range; the message names it."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    """What to sample and when to stop. Defaults are greedy decoding."""

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    logprobs: bool = False
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs, ids ascending and distinct
    grammar: str | None = None  # llguidance grammar text the output must match (mlxcel.engine.grammar)

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise SamplingError("max_tokens", "max_tokens must be an integer")
        if not 1 <= self.max_tokens <= MAX_TOKENS_LIMIT:
            raise SamplingError("max_tokens", f"max_tokens must be between 1 and {MAX_TOKENS_LIMIT}, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 2.0:
            raise SamplingError("temperature", f"temperature must be between 0 and 2, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise SamplingError("top_k", f"top_k must be >= 0, got {self.top_k}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise SamplingError("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        if any(not s for s in self.stop):
            raise SamplingError("stop", "stop strings must not be empty")
        self._check_processors()

    def _check_processors(self) -> None:
        if not 0.0 <= self.min_p <= 1.0:
            raise SamplingError("min_p", f"min_p must be between 0 and 1, got {self.min_p}")
        if not 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise SamplingError("repetition_penalty", f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}], "
                                f"got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -PENALTY_LIMIT <= value <= PENALTY_LIMIT:
                raise SamplingError(name, f"{name} must be between -2 and 2, got {value}")
        check_logit_bias(self.logit_bias)
        if self.grammar is not None:
            try:
                check_text(self.grammar)
            except GrammarError as exc:
                raise SamplingError("grammar", str(exc)) from None

    @property
    def processed(self) -> bool:
        """Whether logits processors apply (a penalty or a logit_bias): the row keeps a token history."""
        return bool(self.logit_bias) or self.repetition_penalty != 1.0 or bool(self.presence_penalty) \
            or bool(self.frequency_penalty)

    @property
    def constrained(self) -> bool:
        """Whether a grammar masks the row's tokens (the row replays what it generated before)."""
        return self.grammar is not None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def check_logit_bias(pairs: tuple[tuple[int, float], ...], vocab_size: int | None = None) -> None:
    """``SamplingError`` (param ``logit_bias``) unless ``pairs`` are at most ``MAX_LOGIT_BIAS`` (id, bias)
    pairs, ids distinct, ascending and below ``vocab_size`` (None: unchecked), biases in [-100, 100]."""
    if len(pairs) > MAX_LOGIT_BIAS:
        raise SamplingError("logit_bias", f"logit_bias holds {len(pairs)} entries; at most {MAX_LOGIT_BIAS}")
    last = -1
    for token, bias in pairs:
        if isinstance(token, bool) or not isinstance(token, int) or token <= last:
            raise SamplingError("logit_bias", "logit_bias token ids must be distinct integers >= 0 in ascending order")
        if vocab_size is not None and token >= vocab_size:
            raise SamplingError("logit_bias", f"logit_bias names token {token}; the vocabulary has {vocab_size}")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
            raise SamplingError("logit_bias", f"logit_bias values must be numbers between -100 and 100, got {bias!r}")
        last = token


_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15  # SplitMix64's increment


def draw_seed(seed: int, draw: int) -> int:
    """The 64-bit seed of a sequence's draw number ``draw`` (0 for its first sampled token): output
    ``draw`` of SplitMix64 seeded with ``seed`` (mod 2^64). A token's random key depends only on the
    request's seed and its position in the output, never on the draws before it, so a sequence resumed
    elsewhere after ``draw`` tokens (docs/pipeline.md §5.6) samples exactly what it would have."""
    z = ((seed & _MASK64) + (draw + 1) * _GAMMA) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


class SeededSampler:
    """Temperature / top-p / min-p / top-k sampling of one sequence; draw ``n`` uses the key
    ``mx.random.key(draw_seed(seed, n))``, so ``skip`` is O(1) and a resume reproduces the stream."""

    def __init__(self, params: SamplingParams, seed: int, draws: int = 0):
        self.params = params
        self.seed = seed
        self.draws = draws  # tokens sampled so far (here or, before a resume, elsewhere)
        self._inv_temp = 1.0 / params.temperature

    def skip(self, draws: int) -> None:
        """Go past ``draws`` tokens sampled elsewhere (a prefill node, the run before a resume)."""
        self.draws += draws

    def __call__(self, logprobs: mx.array) -> mx.array:
        params = self.params
        if params.top_p < 1.0:
            logprobs = apply_top_p(logprobs, params.top_p)
        if params.min_p > 0.0:  # mlx-lm's order: top-p, min-p, top-k
            logprobs = apply_min_p(logprobs, params.min_p)
        if 0 < params.top_k < logprobs.shape[-1]:
            logprobs = apply_top_k(logprobs, params.top_k)
        key = mx.random.key(draw_seed(self.seed, self.draws))
        self.draws += 1
        return mx.random.categorical(logprobs * self._inv_temp, key=key)


def random_seed() -> int:
    """A seed from the OS for a request that names none."""
    return int.from_bytes(os.urandom(8), "little") >> 1


def make_sampler(params: SamplingParams, draws: int = 0) -> Sampler:
    """A callable mapping log-probabilities [B, V] to token ids [B].

    Each sampler owns its random stream (from ``params.seed``, else from the OS), so concurrent requests
    never disturb each other's draws; ``draws`` starts it after that many tokens (a resumed sequence).
    """
    if params.greedy:
        return lambda logprobs: mx.argmax(logprobs, axis=-1)
    seed = params.seed if params.seed is not None else random_seed()
    return SeededSampler(params, seed, draws)
