"""Single-sequence generation: prefill, decode over a KV cache, sampling, streaming text.

Layered like mlx-lm: ``generate_tokens`` yields (token, logprobs) from any
forward callable (a whole model or a pipeline of slices); ``stream_generate``
adds detokenization and stop handling (``SequenceText``, shared with the
batching engine) and statistics.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from mlxcel.config import PREFILL_STEP
from mlxcel.engine.model_slice import ModelSlice
from mlxcel.engine.prefill_split import prompt_chunk
from mlxcel.engine.sampling import SamplingParams, make_sampler
from mlxcel.engine.textstream import SequenceText

Forward = Callable[[mx.array, list], mx.array]
Prefill = Callable[[mx.array, list], None]  # fills the cache with prompt tokens [n]
_stream = mx.new_stream(mx.default_device())


def make_cache(model: Any) -> list:
    """A fresh KV cache for a whole model or for a ModelSlice (its layers only)."""
    if isinstance(model, ModelSlice):
        return model.make_cache()
    return make_prompt_cache(model)


def generate_tokens(
    forward: Forward,
    prompt: Sequence[int],
    cache: list,
    sampler: Callable[[mx.array], mx.array],
    max_tokens: int,
    *,
    prefill_chunk: int = PREFILL_STEP,
    prefill: Prefill | None = None,
) -> Iterator[tuple[int, mx.array]]:
    """Yield up to ``max_tokens`` (token, logprobs) pairs; the next step is queued before each yield.

    ``prefill`` (e.g. ``InProcessPipeline.prefill``) fills the cache with all but the last prompt token
    in its own way; without it they go through ``forward`` in chunks of ``prefill_chunk``."""
    tokens = mx.array(list(prompt), dtype=mx.uint32)

    def step(inputs: mx.array) -> tuple[mx.array, mx.array]:
        with mx.stream(_stream):
            logits = forward(inputs[None], cache)[:, -1, :]
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            return sampler(logprobs), logprobs[0]

    if prefill is not None and tokens.size > 1:
        prefill(tokens[:-1], cache)
        tokens = tokens[-1:]
    with mx.stream(_stream):
        # All but the last prompt token only fill the cache: evaluating just the
        # cache state leaves the (lazy) head unevaluated for those positions.
        while tokens.size > 1:
            n = prompt_chunk(tokens.size, prefill_chunk)
            forward(tokens[None, :n], cache)
            mx.eval([c.state for c in cache])
            tokens = tokens[n:]
    y, logprobs = step(tokens)
    mx.async_eval(y, logprobs)
    for n in range(max_tokens):
        if n + 1 < max_tokens:
            next_y, next_logprobs = step(y)
            mx.async_eval(next_y, next_logprobs)
        yield int(y.item()), logprobs
        if n + 1 < max_tokens:
            y, logprobs = next_y, next_logprobs
        if n % 256 == 255:
            mx.clear_cache()


@dataclass
class GenerationChunk:
    """One streamed piece of output; the last one has ``finish_reason`` set."""

    text: str
    token: int | None
    logprob: float | None = None
    finish_reason: str | None = None  # "stop" (EOS or stop string) | "length"


@dataclass
class GenerationStats:
    """Timings of one generation, filled in as it runs."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    prompt_seconds: float = 0.0
    decode_seconds: float = 0.0
    token_times: list[float] = field(default_factory=list)  # seconds between consecutive tokens
    peak_memory_gb: float = 0.0

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_seconds if self.prompt_seconds else 0.0

    @property
    def decode_tps(self) -> float:
        n = self.generation_tokens - 1
        return n / self.decode_seconds if n > 0 and self.decode_seconds else 0.0


def stream_generate(
    model: Any,
    tokenizer: Any,
    prompt: Sequence[int],
    params: SamplingParams,
    *,
    forward: Forward | None = None,
    prefill: Prefill | None = None,
    stats: GenerationStats | None = None,
) -> Iterator[GenerationChunk]:
    """Generate text for token ids ``prompt``; EOS and stop strings end with finish_reason "stop"."""
    stats = stats if stats is not None else GenerationStats()
    stats.prompt_tokens = len(prompt)
    forward = forward or (lambda x, c: model(x, cache=c))
    text_out = SequenceText(tokenizer, params.stop)
    eos = set(tokenizer.eos_token_ids)
    mx.reset_peak_memory()
    tokens = generate_tokens(forward, prompt, make_cache(model), make_sampler(params), params.max_tokens,
                             prefill=prefill)
    start = last = time.perf_counter()
    finish = "length"
    for n, (token, logprobs) in enumerate(tokens):
        now = time.perf_counter()
        if n == 0:
            stats.prompt_seconds = now - start
        else:
            stats.token_times.append(now - last)
            stats.decode_seconds += now - last
        last = now
        stats.generation_tokens = n + 1
        if token in eos:
            finish = "stop"
            break
        text = text_out.feed(token)
        logprob = float(logprobs[token].item()) if params.logprobs else None
        if text_out.stopped:
            yield GenerationChunk(text=text, token=token, logprob=logprob)
            finish = "stop"
            break
        if text or params.logprobs:
            yield GenerationChunk(text=text, token=token, logprob=logprob)
    tail = text_out.finish()
    stats.peak_memory_gb = mx.get_peak_memory() / 1e9
    yield GenerationChunk(text=tail, token=None, finish_reason=finish)
