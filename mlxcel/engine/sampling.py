"""Sampling parameters and samplers: greedy, temperature, top-p, top-k, per-request seed."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_k, apply_top_p

from mlxcel.config import DEFAULT_MAX_TOKENS, MAX_STOP_STRINGS, MAX_TOKENS_LIMIT

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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def make_sampler(params: SamplingParams) -> Sampler:
    """A callable mapping log-probabilities [B, V] to token ids [B].

    Each sampler owns its random key (from ``params.seed``, else from the OS), so concurrent requests never disturb each other's draws.
    """
    if params.greedy:
        return lambda logprobs: mx.argmax(logprobs, axis=-1)
    seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
    key = mx.random.key(seed)
    state = {"key": key}
    inv_temp = 1.0 / params.temperature

    def sample(logprobs: mx.array) -> mx.array:
        if params.top_p < 1.0:
            logprobs = apply_top_p(logprobs, params.top_p)
        if 0 < params.top_k < logprobs.shape[-1]:
            logprobs = apply_top_k(logprobs, params.top_k)
        state["key"], sub = mx.random.split(state["key"])
        return mx.random.categorical(logprobs * inv_temp, key=sub)

    return sample
