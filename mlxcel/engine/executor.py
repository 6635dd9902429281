"""The seam between the scheduler and the compute: ``Executor`` runs steps the scheduler plans.

The scheduler (``mlxcel.engine.scheduler``) decides *what* runs: which request is admitted, which
prompt chunk is prefilled, which rows form a decode micro-batch, when a request ends. An executor
decides *where*: ``LocalExecutor`` runs the whole model on this host;
``mlxcel.pipeline.coordinator.PipelineExecutor`` drives remote pipeline stages. Up to
``depth`` steps may be in flight at once (micro-batching: with two stages, one micro-batch is on
stage 1 while the next is on stage 0). Every submitted step completes exactly once through its
``done`` callback, with a list of ``Sampled`` (one per row), ``None`` (an intermediate prompt
chunk) or an exception; callbacks may come from any thread.

``LocalExecutor`` also moves KV between nodes (disaggregated prefill and decode), in the shape of
vLLM's KV connector: the sending side marks a sequence with ``export_on_finish``, reads what to send
with ``request_finished`` once it ended, and reports the send with ``finished_sending``, which frees
it; the receiving side installs what arrived with ``adopt``.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence, Union

import mlx.core as mx
from mlx_lm.generate import generation_stream

from mlxcel.engine import steptrace
from mlxcel.engine.compiled_step import decode_forward
from mlxcel.engine.model_slice import ModelSlice
from mlxcel.engine.prefix_cache import PrefixCache
from mlxcel.engine.runner import RowSampler, Sampled, SliceRunner
from mlxcel.engine.sampling import SamplingParams
from mlxcel.error_codes import CodedError

_steps = itertools.count(1)


@dataclass(eq=False)
class Step:
    """One unit of work: a prompt chunk of one sequence, or one decode step of a micro-batch.

    ``tokens`` is [rows][positions]: one row of prompt tokens for a prefill, one token per row for a
    decode. ``sample`` asks the last stage to sample (the final chunk of a prompt, every decode).
    """

    kind: str  # "prefill" | "decode"
    rids: list[str]
    tokens: list[list[int]]
    slot: int = -1  # the micro-batch of a decode step
    sample: bool = True
    id: int = field(default_factory=lambda: next(_steps))

    @property
    def rows(self) -> int:
        return len(self.rids)


StepOutcome = Union[list[Sampled], None, BaseException]
Done = Callable[[Step, StepOutcome], None]


Exporter = Callable[[list, int], Any]  # (per-layer caches, tokens they hold) -> what is sent
Importer = Callable[[Any], list]  # what was received -> per-layer caches


@dataclass(frozen=True)
class KVExport:
    """What to send for a sequence that ended here: the exporter's ``data`` for its ``length`` tokens."""

    data: Any
    length: int


@dataclass(frozen=True)
class KVImport:
    """KV received from elsewhere, for ``adopt``: the importer's input and the sampler draws made there."""

    data: Any
    draws: int = 0


class ExecutorError(CodedError):
    """A step or a command failed in the executor; ``code`` (an ``ErrorCode``) classifies it, and
    ``peer_code`` keeps what a remote peer reported when that was turned into a local code."""


class Executor(Protocol):
    """What the scheduler needs from the compute."""

    depth: int  # steps that may be in flight at once
    micro_batch_size: int  # rows per decode step at most

    def prepare(self, rid: str, params: SamplingParams, top_logprobs: int, prompt: Sequence[int]) -> int:
        """Make room for a sequence; returns how many leading prompt tokens are already cached.

        An executor that resumes sequences (``mlxcel.engine.resume``) also takes ``draws=n`` and
        ``attempt=k``: the sequence's ``k``-th resume, after ``n`` sampled tokens, so its sampler starts at
        draw ``n`` (a remote executor may name it anew per attempt, so stale steps cannot touch it)."""

    def submit(self, step: Step, done: Done) -> None:
        """Start a step; ``done`` is called exactly once when it finishes or fails."""

    def release(self, rid: str, tokens: Sequence[int] | None = None) -> None:
        """Free a sequence everywhere; ``tokens`` offers its KV to the prefix cache under those tokens."""

    # optional: ``cancel(rid)`` frees a sequence whose client gave up (the pipeline sends CANCEL, which
    # each stage acknowledges); without it the scheduler calls ``release(rid, None)``.

    def stats(self) -> dict[str, float]:
        """Executor counters for /metrics."""

    def health(self) -> dict[str, Any]:
        """{"status": "ok" | "degraded", ...} for /health."""

    def close(self) -> None:
        """Release everything; fail nothing (the scheduler already did)."""


class LocalExecutor:
    """Runs steps synchronously on this host, on the whole model (in-process stages are
    ``mlxcel.pipeline.inprocess.InProcessPipeline``, for ``mlxcel generate --pp-size``).

    ``exporter`` and ``importer`` convert KV for the wire (default: the mlx-lm caches themselves);
    ``step_delay_s`` sleeps before every decode step (a test and rehearsal aid).
    """

    depth = 1

    def __init__(self, model: Any, *, max_batch_size: int, prefix_cache_bytes: int = 0,
                 exporter: Exporter | None = None, importer: Importer | None = None, step_delay_s: float = 0.0):
        self.micro_batch_size = max_batch_size
        self.runners = [whole_model_runner(model, max_rows=max_batch_size)]
        self.prefix = PrefixCache(prefix_cache_bytes)
        self.exporter: Exporter = exporter or (lambda cache, length: cache)
        self.importer: Importer = importer or (lambda data: data)
        self.step_delay_s = step_delay_s
        self._exports: dict[str, KVExport | Exception | None] = {}  # rid -> its export once it ended
        self._lock = threading.Lock()  # _exports: the scheduler thread fills it, the sender reads and frees it

    def prepare(self, rid: str, params: SamplingParams, top_logprobs: int, prompt: Sequence[int], *,
                draws: int = 0, attempt: int = 0) -> int:
        cache, n = self.prefix.lookup(prompt)
        for i, runner in enumerate(self.runners):
            row = RowSampler(params, top_logprobs) if runner.is_last else None
            if row is not None:
                row.skip(draws)
            runner.prepare(rid, row, cache=cache if i == 0 else None, length=n)
        return n

    def adopt(self, rid: str, params: SamplingParams, top_logprobs: int, cache: list | KVImport, length: int) -> None:
        """Install a KV cache filled elsewhere holding ``length`` tokens: mlx-lm caches (a ``take_cache``), or
        a ``KVImport`` that the importer turns into them here, its sampler advanced past the draws made there."""
        draws = 0
        if isinstance(cache, KVImport):
            cache, draws = self.importer(cache.data), cache.draws
        runner = self.runners[0]
        layers = len(runner._make_cache())  # noqa: SLF001 - the layer count a cache must have
        if not isinstance(cache, list) or len(cache) != layers:
            raise ValueError(f"the cache of {rid} must be a list of {layers} layer caches")
        offset = getattr(cache[0], "offset", length)
        if offset != length:
            raise ValueError(f"the cache of {rid} holds {offset} tokens, its prompt has {length}")
        row = RowSampler(params, top_logprobs)
        row.skip(draws)
        runner.prepare(rid, row, cache=cache, length=length)

    # -- the sending side of a KV handoff ---------------------------------------------------------

    def export_on_finish(self, rid: str) -> None:
        """Export ``rid``'s KV when it ends (is released with its tokens), for ``request_finished``."""
        with self._lock:
            self._exports[rid] = None

    def request_finished(self, rid: str) -> KVExport | None:
        """What to send for ``rid`` once it ended; None if it has not, or ended without KV (cancelled, failed).

        Raises what the exporter raised. The export stays held here until ``finished_sending``.
        """
        with self._lock:
            got = self._exports.get(rid)
        if isinstance(got, Exception):
            raise got
        return got

    def finished_sending(self, rid: str) -> None:
        """The send of ``rid``'s KV completed, failed or was given up: free its export."""
        with self._lock:
            self._exports.pop(rid, None)

    def _export(self, rid: str) -> None:
        """Export ``rid``'s KV if ``export_on_finish`` asked for it (on the model's thread)."""
        with self._lock:
            if rid not in self._exports:
                return
        taken = self.runners[0].take_cache(rid)
        got: KVExport | Exception | None = None
        try:
            if taken is not None:
                got = KVExport(self.exporter(*taken), taken[1])
        except Exception as exc:  # noqa: BLE001 - request_finished raises it to the sender
            got = exc
        with self._lock:
            if rid in self._exports:  # not given up meanwhile
                self._exports[rid] = got

    def submit(self, step: Step, done: Done) -> None:
        try:
            outcome: StepOutcome = self.run(step)
        except Exception as exc:  # noqa: BLE001 - reported to the scheduler, which fails the rows
            outcome = exc
        done(step, outcome)

    def run(self, step: Step) -> list[Sampled] | None:
        if self.step_delay_s and step.kind == "decode":
            time.sleep(self.step_delay_s)
        with mx.stream(generation_stream):
            x: Any = mx.array(step.tokens, dtype=mx.uint32)
            for runner in self.runners:
                if step.kind == "prefill":
                    x = runner.prefill(step.rids[0], x, sample=step.sample)
                else:
                    x = runner.decode(step.slot, step.rids, x)
        return x

    def release(self, rid: str, tokens: Sequence[int] | None = None) -> None:
        if tokens is not None:
            self._export(rid)
        if tokens is not None and self.prefix.max_bytes > 0:
            taken = self.runners[0].take_cache(rid)
            if taken is not None:
                cache, length = taken
                self.prefix.store(list(tokens)[:length], cache)
        for runner in self.runners:
            runner.release(rid)

    def stats(self) -> dict[str, float]:
        return {"prefix_hits": self.prefix.hits, "prefix_tokens": self.prefix.reused_tokens,
                "prefix_bytes": self.prefix.nbytes}

    def health(self) -> dict[str, Any]:
        return {"status": "ok"}

    def close(self) -> None:
        for runner in self.runners:
            runner.release_all()
        with self._lock:
            self._exports.clear()
        mx.synchronize(generation_stream)


def whole_model_runner(model: Any, *, max_rows: int) -> SliceRunner:
    """The whole model as one runner: mlx-lm's own forward, so every family it supports works."""
    from mlx_lm.models.cache import make_prompt_cache

    return SliceRunner(decode_forward(lambda x, c: model(x, cache=c)), lambda: make_prompt_cache(model),
                       is_first=True, is_last=True, max_rows=max_rows)


def slice_runner(model: Any, start: int, end: int, *, max_rows: int) -> SliceRunner:
    """Layers [start, end) of ``model`` as a runner (a pipeline stage)."""
    piece = ModelSlice(model, start, end)
    return SliceRunner(decode_forward(lambda x, c: piece(x, c)), piece.make_cache, is_first=piece.is_first,
                       is_last=piece.is_last, max_rows=max_rows,
                       input_width=None if piece.is_first else piece.input_width)
