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
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence, Union

import mlx.core as mx
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import KVCache

from mlxcel import envs
from mlxcel.engine.batch_rows import OneRow, one_row, unmergeable
from mlxcel.engine.model_slice import ModelSlice
from mlxcel.engine.prefix_cache import PrefixCache
from mlxcel.engine.resume_policy import ResumePolicy
from mlxcel.engine.logits import replayed
from mlxcel.engine.runner import PendingSample, RowSampler, Sampled, SliceRunner
from mlxcel.engine.sampling import SamplingParams
from mlxcel.error_codes import CodedError, ErrorCode

_steps = itertools.count(1)
log = logging.getLogger("mlxcel.engine")


@dataclass(eq=False)
class Step:
    """One unit of work: a prompt chunk of one sequence, or one decode step of a micro-batch.

    ``tokens`` is [rows][positions]: one row of prompt tokens for a prefill, one token per row for a
    decode. ``sample`` asks the last stage to sample (the final chunk of a prompt, every decode).
    """

    kind: str  # "prefill" | "decode"
    rids: list[str]  # a decode row's token may be PREVIOUS (executors with ``lookahead``, below)
    tokens: list[list[int]]
    slot: int = -1  # the micro-batch of a decode step
    sample: bool = True
    id: int = field(default_factory=lambda: next(_steps))

    @property
    def rows(self) -> int:
        return len(self.rids)


PREVIOUS = -1  # a decode row's input: the token this row sampled in the previous step of its micro-batch

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
    """KV received from elsewhere, for ``adopt``: the importer's input, the sampler draws made there and the
    tokens the logits processors look back over (the prompt's tail and the token sampled there)."""

    data: Any
    draws: int = 0
    context: tuple[int, ...] = ()
    replay: tuple[int, ...] = ()  # the tokens generated so far, for a grammar (mlxcel.engine.grammar)


class ExecutorError(CodedError):
    """A step or a command failed in the executor; ``code`` (an ``ErrorCode``) classifies it, and
    ``peer_code`` keeps what a remote peer reported when that was turned into a local code."""


class ExecutorBase:
    """What the scheduler needs from the compute: every hook it calls, each optional one with its default.

    Every executor derives from it (``LocalExecutor``, the pipeline coordinator's ``PipelineExecutor``,
    the tensor-parallel ``TPExecutor``), so the scheduler calls hooks instead of probing for them. A
    subclass sets ``depth`` and ``micro_batch_size`` and implements ``prepare``, ``submit`` and ``release``;
    it overrides an optional hook only to do more than its default.
    """

    depth: int = 1  # steps that may be in flight at once
    micro_batch_size: int  # rows per decode step at most
    fill_micro_batches: bool = False  # fill one decode group before the next instead of spreading rows evenly
    resume_policy: ResumePolicy | None = None  # resume requests a node failure lost (mlxcel.engine.resume)
    adopts: bool = False  # ``adopt`` installs a KV cache filled elsewhere (``Scheduler.submit_prefilled``)

    def prepare(self, rid: str, params: SamplingParams, top_logprobs: int, prompt: Sequence[int], *,
                draws: int = 0, attempt: int = 0) -> int:
        """Make room for a sequence; returns how many leading prompt tokens are already cached.

        ``draws=n`` starts its sampler at draw ``n`` (it sampled ``n`` tokens elsewhere or before a resume);
        ``attempt=k`` is its ``k``-th resume (a remote executor may name it anew per attempt, so stale steps
        cannot touch it). Only an executor that resumes or takes re-prefills needs to accept them."""
        raise NotImplementedError

    def submit(self, step: Step, done: Done) -> None:
        """Start a step; ``done`` is called exactly once when it finishes or fails."""
        raise NotImplementedError

    def release(self, rid: str, tokens: Sequence[int] | None = None) -> None:
        """Free a sequence everywhere; ``tokens`` offers its KV to the prefix cache under those tokens."""
        raise NotImplementedError

    def adopt(self, rid: str, params: SamplingParams, top_logprobs: int, cache: Any, length: int) -> None:
        """Install ``cache``, filled elsewhere with ``length`` prompt tokens, as a new sequence's KV cache
        (only where ``adopts``)."""
        raise TypeError(f"{type(self).__name__} has no adopt method: it cannot take prefilled sequences")

    def cancel(self, rid: str) -> None:
        """Free a sequence whose client gave up (the pipeline sends CANCEL, which each stage acknowledges);
        by default a ``release`` that offers nothing to the prefix cache."""
        self.release(rid, None)

    def start_async(self) -> int:
        """Asynchronous scheduling, for a driver that polls (the scheduler calls it once): returns the
        lookahead it allows, 0 (the default) for none. Once started with a lookahead, ``submit`` only queues
        the step on the device and returns; ``poll`` waits for the oldest queued step and calls its ``done``
        (steps complete in submission order). Up to ``lookahead`` more decode steps of a micro-batch may be
        submitted while one is queued: a row of such a step that was in the step before takes the token
        ``PREVIOUS``, which the executor reads on the device from that step's samples."""
        return 0

    def poll(self) -> bool:
        """Report the oldest queued step (asynchronous scheduling); False when none is queued."""
        return False

    def resumable(self, exc: BaseException) -> bool:
        """Whether a failed step or start lost the sequence's state to a node failure (resume or hold it)
        rather than failed on the request itself; by default never."""
        return False

    def check_peers(self) -> None:
        """Before resuming: raise if no node can take a sequence now (a restarted one is seen first)."""

    def stats(self) -> dict[str, float]:
        """Executor counters for /metrics."""
        return {}

    def health(self) -> dict[str, Any]:
        """{"status": "ok" | "degraded", ...} for /health."""
        return {"status": "ok"}

    def close(self) -> None:
        """Release everything; fail nothing (the scheduler already did)."""


Executor = ExecutorBase  # the name the docs and type hints use


class LocalExecutor(ExecutorBase):
    """Runs steps synchronously on this host, on the whole model (in-process stages are
    ``mlxcel.pipeline.inprocess.InProcessPipeline``, for ``mlxcel generate --pp-size``).

    ``exporter`` and ``importer`` convert KV for the wire (default: the mlx-lm caches themselves);
    ``step_delay_s`` sleeps before every decode step (a test and rehearsal aid).

    Asynchronous scheduling (``start_async``, which the scheduler calls; lookahead 1 on a GPU where every
    layer's cache is a plain ``KVCache``, 0 on a CPU unless ``MLXCEL_ASYNC_SCHED=1``, with
    ``MLXCEL_ASYNC_SCHED=0`` or with ``lookahead=0``): ``submit`` builds the step's graph and
    queues it with ``mx.async_eval``, sampling included, and ``poll`` reads the sampled ids of the oldest
    step (one transfer for the batch) and reports it. A row that ended at step N (EOS, a stop string,
    a cancel) has already been queued in step N+1; that token is dropped and its cache holds one
    position more than its tokens, which the prefix cache cuts off. A row that reaches ``max_tokens`` at
    step N is known in advance: step N+1 leaves it out, and it keeps its own cache until released. Layers whose cache cannot be cut
    (sliding windows, linear attention) keep ``lookahead`` 0, so their caches never see such a position.

    A model whose caches cannot join a batch (``batch_rows.one_row``: a cache class with no ``merge``) decodes
    one row per step whatever ``max_batch_size`` asks: the scheduler's ``max_batch_size`` follows, the other
    sequences wait their turn, start-up logs why once and ``health`` says it (``batching``).
    """

    depth = 1
    adopts = True

    def __init__(self, model: Any, *, max_batch_size: int, prefix_cache_bytes: int = 0,
                 exporter: Exporter | None = None, importer: Importer | None = None, step_delay_s: float = 0.0,
                 lookahead: int | None = None):
        self.one_row = cap_rows(model)
        max_batch_size = 1 if self.one_row is not None else max_batch_size
        self.micro_batch_size = max_batch_size
        self.runners = [whole_model_runner(model, max_rows=max_batch_size)]
        # what asynchronous scheduling may use here; in effect (``lookahead``) once a driver that polls asks
        self.max_lookahead = default_lookahead(self.runners[0]) if lookahead is None else min(max(lookahead, 0), 1)
        self.lookahead = 0
        self._queued: deque[tuple[Step, Any, Done]] = deque()  # submitted, not yet reported (lookahead only)
        self._last: dict[int, tuple[list[str], mx.array]] = {}  # slot -> rows and sampled ids of its last step
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
            row = RowSampler(params, top_logprobs, context=prompt, replay=replayed(params, prompt, draws)) \
                if runner.is_last else None
            if row is not None:
                row.skip(draws)
            runner.prepare(rid, row, cache=cache if i == 0 else None, length=n)
        return n

    def adopt(self, rid: str, params: SamplingParams, top_logprobs: int, cache: list | KVImport, length: int) -> None:
        """Install a KV cache filled elsewhere holding ``length`` tokens: mlx-lm caches (a ``take_cache``), or
        a ``KVImport`` that the importer turns into them here, its sampler advanced past the draws made there."""
        draws, context, replay = 0, (), ()
        if isinstance(cache, KVImport):
            cache, draws, context, replay = self.importer(cache.data), cache.draws, cache.context, cache.replay
        runner = self.runners[0]
        layers = len(runner._make_cache())  # noqa: SLF001 - the layer count a cache must have
        if not isinstance(cache, list) or len(cache) != layers:
            raise ValueError(f"the cache of {rid} must be a list of {layers} layer caches")
        offset = getattr(cache[0], "offset", length)
        if offset != length:
            raise ValueError(f"the cache of {rid} holds {offset} tokens, its prompt has {length}")
        row = RowSampler(params, top_logprobs, context=context, replay=replay)
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

    def _export(self, rid: str, tokens: int) -> None:
        """Export ``rid``'s KV if ``export_on_finish`` asked for it (on the model's thread): its first
        ``tokens`` positions (a row queued one step past its end holds one more)."""
        with self._lock:
            if rid not in self._exports:
                return
        taken = self.runners[0].take_cache(rid)
        got: KVExport | Exception | None = None
        try:
            if taken is not None:
                length = min(taken[1], tokens)
                got = KVExport(self.exporter(taken[0], length), length)
        except Exception as exc:  # noqa: BLE001 - request_finished raises it to the sender
            got = exc
        with self._lock:
            if rid in self._exports:  # not given up meanwhile
                self._exports[rid] = got

    def submit(self, step: Step, done: Done) -> None:
        if self.lookahead:
            try:
                queued: Any = self._launch(step)
            except Exception as exc:  # noqa: BLE001 - reported in order by poll, like a result
                queued = exc
            self._queued.append((step, queued, done))
            return
        try:
            outcome: StepOutcome = self.run(step)
        except Exception as exc:  # noqa: BLE001 - reported to the scheduler, which fails the rows
            outcome = exc
        done(step, outcome)

    def start_async(self) -> int:
        """Turn asynchronous scheduling on (for a driver that calls ``poll``: the scheduler); returns the
        lookahead now in effect. Until then ``submit`` runs each step to its end and reports it at once."""
        self.lookahead = self.max_lookahead
        self.runners[0].keep_dropped = bool(self.lookahead)
        return self.lookahead

    def poll(self) -> bool:
        """Wait for the oldest queued step and report it through its ``done``; False if none is queued."""
        if not self._queued:
            return False
        step, queued, done = self._queued.popleft()
        outcome: StepOutcome
        if isinstance(queued, BaseException) or queued is None:
            outcome = queued
        else:
            try:
                outcome = queued.resolve()
            except Exception as exc:  # noqa: BLE001 - as in submit
                outcome = exc
        done(step, outcome)
        return True

    def run(self, step: Step) -> list[Sampled] | None:
        """Run ``step`` now and wait for its result (the synchronous path)."""
        return self._launch(step, lazy=False)

    def _launch(self, step: Step, lazy: bool = True) -> Any:
        """Build ``step`` and queue it on the device (``lazy``), or run it to the end."""
        if self.step_delay_s and step.kind == "decode":
            time.sleep(self.step_delay_s)
        with mx.stream(generation_stream):
            x: Any = self._inputs(step)
            for runner in self.runners:
                if step.kind == "prefill":
                    x = runner.prefill(step.rids[0], x, sample=step.sample, lazy=lazy)
                else:
                    x = runner.decode(step.slot, step.rids, x, lazy=lazy)
        if step.kind == "decode" and isinstance(x, PendingSample):
            self._last[step.slot] = (list(step.rids), x.tokens)
        return x

    def _inputs(self, step: Step) -> mx.array:
        """The step's token ids [rows, positions]; ``PREVIOUS`` rows read the last step's samples on the device."""
        if step.kind != "decode" or all(t[0] != PREVIOUS for t in step.tokens):
            return mx.array(step.tokens, dtype=mx.uint32)
        if step.slot not in self._last:
            raise ExecutorError(f"micro-batch {step.slot} has no previous step to take tokens from",
                                ErrorCode.BAD_REQUEST)
        rids, sampled = self._last[step.slot]
        where = {rid: i for i, rid in enumerate(rids)}
        literals = [t[0] for t in step.tokens if t[0] != PREVIOUS]
        index, j = [], len(rids)
        for rid, t in zip(step.rids, step.tokens):
            if t[0] != PREVIOUS:
                index.append(j)
                j += 1
            elif rid in where:
                index.append(where[rid])
            else:
                raise ExecutorError(f"request {rid} was not in the previous step of micro-batch {step.slot}",
                                    ErrorCode.BAD_REQUEST)
        source = sampled.astype(mx.uint32)
        if literals:
            source = mx.concatenate([source, mx.array(literals, dtype=mx.uint32)])
        if index == list(range(len(rids))) and not literals:
            return source.reshape(-1, 1)
        return source[mx.array(index, dtype=mx.int32)].reshape(-1, 1)

    def release(self, rid: str, tokens: Sequence[int] | None = None) -> None:
        if tokens is not None:
            self._export(rid, len(tokens))
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
        return batching_health(self.one_row)

    def close(self) -> None:
        self._queued.clear()
        self._last.clear()
        for runner in self.runners:
            runner.release_all()
        with self._lock:
            self._exports.clear()
        mx.synchronize(generation_stream)


def cap_rows(model: Any) -> OneRow | None:
    """Whether ``model``'s caches keep its decode steps to one row (``batch_rows.one_row``); logs why once."""
    from mlx_lm.models.cache import make_prompt_cache

    cap = one_row(model, make_prompt_cache(model))
    if cap is not None:
        log.warning(cap.reason)
    return cap


def batching_health(cap: OneRow | None) -> dict[str, Any]:
    """An executor's ``health``: ok, with ``batching`` where its model decodes one row at a time."""
    return {"status": "ok"} if cap is None else {"status": "ok", "batching": cap.batching}


def default_lookahead(runner: SliceRunner) -> int:
    """1 (asynchronous scheduling) where every layer's cache is a plain ``KVCache``, whose extra position
    after an ended row can be cut off, and the device is a GPU; 0 otherwise. ``MLXCEL_ASYNC_SCHED=1``
    turns it on on a CPU too, ``=0`` off everywhere.

    Off on a CPU by default: MLX's CPU backend runs most of a step inside ``mx.async_eval`` itself (the
    step trace puts the device time under ``build`` there), so nothing overlaps, and the thinner steps
    of the first tokens cost more than they save (docs/benchmarks.md)."""
    switch = envs.settings().async_sched
    if switch is False or (switch is None and mx.default_device().type != mx.DeviceType.gpu):
        return 0
    caches = runner._make_cache()  # noqa: SLF001 - the layer caches a sequence gets
    return 1 if caches and all(type(c) is KVCache for c in caches) else 0


def layer_overlap() -> bool:
    """Whether a stage queues each layer of a decode step as it is built (``MLXCEL_LAYER_OVERLAP``; unset: on a
    CPU, where MLX computes on its own thread while Python builds the next layer's graph)."""
    switch = envs.settings().layer_overlap
    return mx.default_device() == mx.cpu if switch is None else switch


def whole_model_runner(model: Any, *, max_rows: int) -> SliceRunner:
    """The whole model as one runner: mlx-lm's own forward, so every family it supports works."""
    from mlx_lm.models.cache import make_prompt_cache

    return SliceRunner(lambda x, c: model(x, cache=c), lambda: make_prompt_cache(model),
                       is_first=True, is_last=True, max_rows=max_rows)


def slice_runner(model: Any, start: int, end: int, *, max_rows: int) -> SliceRunner:
    """Layers [start, end) of ``model`` as a runner (a pipeline stage); one row per decode step where the slice's
    caches cannot merge (the coordinator sends no more: ``PipelineExecutor``'s ``one_row``)."""
    piece = ModelSlice(model, start, end)
    if unmergeable(piece.make_cache()) is not None:
        max_rows = 1
    overlap = layer_overlap()
    return SliceRunner(lambda x, c: piece(x, c, overlap=overlap and x.shape[1] == 1), piece.make_cache,
                       is_first=piece.is_first,
                       is_last=piece.is_last, max_rows=max_rows,
                       input_width=None if piece.is_first else piece.input_width)
