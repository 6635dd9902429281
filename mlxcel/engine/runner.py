"""Run one model slice for many sequences: per-sequence prefill, batched decode per micro-batch.

A ``SliceRunner`` is the compute of one pipeline stage (or of the whole model on a single
device). It owns the KV caches of every sequence prepared on it, keyed by request id:

- while a sequence is being prefilled its cache is its own (one row, mlx-lm's per-layer caches);
- once it decodes, its cache lives in the batched cache of its **micro-batch slot**. A decode
  step names the slot and the rows in order; the runner reconciles the slot first: rows of the
  slot that the step no longer names are dropped (finished or cancelled sequences), rows it names
  for the first time are appended (their own caches merged in). So every stage that sees the same
  sequence of steps holds the same rows in the same order, with no extra messages.

The last slice applies the final norm and head and, when asked, samples the last position with
each sequence's own sampler (``RowSampler``); an intermediate prompt chunk evaluates only the cache,
so its (lazy) head output is never computed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import mlx.core as mx

from mlxcel.config import MAX_TOP_LOGPROBS
from mlxcel.engine import steptrace
from mlxcel.engine.batch_rows import Pads, extract_row, filter_rows, join_layer
from mlxcel.engine.logits import RowLogits, row_logits
from mlxcel.engine.sampling import SamplingParams, make_sampler
from mlxcel.error_codes import CodedError, ErrorCode

Forward = Callable[[mx.array, list], mx.array]


class RunnerError(CodedError):
    """A step names rows or shapes this runner cannot accept; the message says which."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message, code)


@dataclass(frozen=True)
class Sampled:
    """One sampled token of one row, with its log-probability and alternatives when asked."""

    token: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass
class RowSampler:
    """A sequence's sampling state: parameters, its own seeded sampler, how many alternatives to report, and
    its logits processors (``mlxcel.engine.logits``: penalties, logit_bias) seeing ``context`` (the tokens
    before its first sampled one, at least the last ``PENALTY_CONTEXT``) then every token it samples; a
    grammar's mask advanced over ``replay`` (the tokens generated before, elsewhere). ``GrammarError``
    where the grammar does not compile here or refuses ``replay``."""

    params: SamplingParams
    top_logprobs: int = 0
    sampler: Callable[[mx.array], mx.array] | None = None
    context: Sequence[int] = ()
    replay: Sequence[int] = ()
    vocab_size: int | None = None
    logits: RowLogits = field(init=False)

    def __post_init__(self) -> None:
        self.top_logprobs = max(0, min(self.top_logprobs, MAX_TOP_LOGPROBS))
        if self.sampler is None and not self.params.greedy:
            self.sampler = make_sampler(self.params)
        self.logits = row_logits(self.params, self.context, self.replay, self.vocab_size)

    def skip(self, draws: int) -> None:
        """Advance a seeded sampler past ``draws`` made elsewhere (a prefill node, the attempt before a
        resume): its random stream goes on (draw n's key depends only on the seed and n)."""
        skip = getattr(self.sampler, "skip", None)
        if skip is not None and draws:
            skip(draws)


@dataclass
class PendingSample:
    """The sampled rows of one step as device arrays, not yet read: ``tokens`` [B], and where a row asks
    for log-probabilities the chosen ones [B] and the top alternatives [B, k] (ids and values).

    ``arrays`` is what to evaluate (``mx.async_eval`` queues it behind the step's forward); ``resolve``
    reads them in one transfer per array, for the whole batch, never per row."""

    rows: Sequence[RowSampler]
    tokens: mx.array
    chosen: mx.array | None = None
    top_ids: mx.array | None = None
    top_values: mx.array | None = None

    @property
    def arrays(self) -> list[mx.array]:
        return [a for a in (self.tokens, self.chosen, self.top_ids, self.top_values) if a is not None]

    def resolve(self) -> list[Sampled]:
        """Wait for the arrays and build one ``Sampled`` per row."""
        with steptrace.phase("device"):
            mx.eval(self.arrays)
        with steptrace.phase("sample"):
            return self._rows()

    def _rows(self) -> list[Sampled]:
        ids = self.tokens.tolist()
        if self.chosen is None:
            return [Sampled(int(t)) for t in ids]
        chosen = self.chosen.tolist()
        top_ids = self.top_ids.tolist() if self.top_ids is not None else None
        top_values = self.top_values.tolist() if self.top_values is not None else None
        out = []
        for i, (token, row) in enumerate(zip(ids, self.rows)):
            if not row.params.logprobs:
                out.append(Sampled(int(token)))
                continue
            top: tuple[tuple[int, float], ...] = ()
            if row.top_logprobs and top_ids is not None and top_values is not None:
                pairs = list(zip(top_ids[i], top_values[i]))[: row.top_logprobs]
                top = tuple((int(t), float(v)) for t, v in sorted(pairs, key=lambda p: -p[1]))
            out.append(Sampled(int(token), float(chosen[i]), top))
        return out


def sample_lazy(logits: mx.array, rows: Sequence[RowSampler]) -> PendingSample:
    """Sample one token per row from last-position logits [B, V], on the device, without waiting."""
    processed = [i for i, r in enumerate(rows) if r.logits]
    if processed:  # the hook: each row's own processors on its own logits (docs/engine.md)
        logits = logits.astype(mx.float32)
        logits = mx.concatenate([r.logits(logits[i : i + 1]) if r.logits else logits[i : i + 1]
                                 for i, r in enumerate(rows)])
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    if all(r.sampler is None for r in rows):
        tokens = mx.argmax(logprobs, axis=-1)
    else:
        tokens = mx.concatenate([
            (r.sampler(logprobs[i : i + 1]) if r.sampler else mx.argmax(logprobs[i : i + 1], axis=-1)).reshape(1)
            for i, r in enumerate(rows)
        ])
    for i in processed:
        rows[i].logits.observe(tokens[i])
    pending = PendingSample(rows, tokens)
    if any(r.params.logprobs for r in rows):
        pending.chosen = mx.take_along_axis(logprobs, tokens.reshape(-1, 1).astype(mx.int32), axis=-1).reshape(-1)
        k = min(max((r.top_logprobs for r in rows if r.params.logprobs), default=0), logprobs.shape[-1])
        if k:
            # the k best of every row (a row asking fewer keeps its first ones after the sort in resolve)
            idx = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[:, :k]
            vals = mx.take_along_axis(logprobs, idx, axis=-1)
            order = mx.argsort(-vals, axis=-1)
            pending.top_ids = mx.take_along_axis(idx, order, axis=-1)
            pending.top_values = mx.take_along_axis(vals, order, axis=-1)
    return pending


def sample_rows(logits: mx.array, rows: Sequence[RowSampler]) -> list[Sampled]:
    """Sample one token per row from last-position logits [B, V] and read them (one transfer per step)."""
    with steptrace.phase("build"):
        pending = sample_lazy(logits, rows)
    return pending.resolve()


@dataclass(eq=False)
class _Seq:
    rid: str
    cache: list | None  # own cache while prefilling; None once it lives in a slot
    row: RowSampler | None = None
    slot: int | None = None
    length: int = 0  # tokens in its cache


@dataclass(eq=False)
class _Slot:
    rids: list[str] = field(default_factory=list)
    cache: list = field(default_factory=list)  # per layer: one row's cache, or a batched cache
    # whether ``cache`` is merged (mlx-lm's batch caches); known here, since a one-row ArraysCache
    # (linear attention) looks like a merged one
    batched: bool = False
    # per layer, each row's left padding in the batched cache, known on the host (``batch_rows``)
    pads: list[Pads] = field(default_factory=list)


class SliceRunner:
    """The caches and the compute of one slice for every sequence prepared on it."""

    def __init__(self, forward: Forward, make_cache: Callable[[], list], *, is_first: bool, is_last: bool,
                 max_rows: int = 64, input_width: int | None = None):
        self.forward = forward
        # the last dimension of the hidden states a non-first slice takes (None: the model's hidden size)
        self.input_width = input_width
        self._make_cache = make_cache
        self.is_first = is_first
        self.is_last = is_last
        self.max_rows = max_rows
        self._seqs: dict[str, _Seq] = {}
        self._slots: dict[int, _Slot] = {}
        # a row a decode step no longer names keeps its own cache until released (asynchronous scheduling
        # plans step N+1 without the rows that end at step N), instead of being forgotten at once
        self.keep_dropped = False

    # -- sequences -------------------------------------------------------------------------

    def __contains__(self, rid: str) -> bool:
        return rid in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    def prepare(self, rid: str, row: RowSampler | None = None, cache: list | None = None, length: int = 0) -> None:
        """A fresh sequence (any earlier state under this id is discarded), optionally seeded with a cache."""
        self.release(rid)
        self._seqs[rid] = _Seq(rid, cache if cache is not None else self._make_cache(), row, length=length)

    def release(self, rid: str) -> None:
        """Forget a sequence and free its cache (its row leaves its slot at once)."""
        seq = self._seqs.pop(rid, None)
        if seq is None or seq.slot is None:
            return
        slot = self._slots[seq.slot]
        if rid in slot.rids:
            self._filter(slot, [i for i, r in enumerate(slot.rids) if r != rid])

    def release_all(self) -> None:
        self._seqs.clear()
        self._slots.clear()

    def take_cache(self, rid: str) -> tuple[list, int] | None:
        """A standalone copy of a sequence's cache and its length (for the prefix cache)."""
        seq = self._seqs.get(rid)
        if seq is None:
            return None
        if seq.slot is None:
            return seq.cache, seq.length
        slot = self._slots[seq.slot]
        return self._row_cache(slot, slot.rids.index(rid)), seq.length

    # -- compute ---------------------------------------------------------------------------

    def prefill(self, rid: str, inputs: mx.array, *, sample: bool, logits: bool = False,
                lazy: bool = False) -> mx.array | list[Sampled] | PendingSample | None:
        """One chunk of one sequence's prompt: token ids [1, L] (first slice) or hidden [1, L, D].

        Returns the hidden states to pass on (not last), the sampled first token (last, ``sample``;
        its last-position logits [1, V] instead when ``logits``), or None (last, an intermediate
        chunk: only the cache is evaluated). With ``lazy`` nothing is waited for: the hidden states are
        queued with ``mx.async_eval`` (not last), the sampled token comes as a ``PendingSample`` queued
        the same way (last), an intermediate chunk is queued.
        """
        seq = self._require(rid)
        if seq.slot is not None:
            raise RunnerError(ErrorCode.BAD_REQUEST, f"sequence {rid} is already decoding; it cannot be prefilled again")
        with steptrace.phase("build"):
            out = self.forward(inputs, seq.cache)
        seq.length += inputs.shape[1]
        if not self.is_last:
            self._settle(out, lazy)
            return out
        if not sample:
            self._settle([c.state for c in seq.cache], lazy)
            return None
        if logits:
            return self._logits(out)
        return self._sample(out[:, -1, :], [seq], lazy)

    def decode(self, slot_id: int, rids: Sequence[str], inputs: mx.array, *, logits: bool = False,
               lazy: bool = False) -> mx.array | list[Sampled] | PendingSample:
        """One decode step of micro-batch ``slot_id``: rows ``rids`` in order, inputs [B, 1] or [B, 1, D]
        (``lazy``: the sampled rows as a queued ``PendingSample``, as for ``prefill``)."""
        if not rids or len(rids) > self.max_rows:
            raise RunnerError(ErrorCode.BAD_REQUEST, f"a decode step needs 1 to {self.max_rows} rows, got {len(rids)}")
        if inputs.shape[0] != len(rids):
            raise RunnerError(ErrorCode.BAD_TENSOR, f"{inputs.shape[0]} input rows for {len(rids)} request ids")
        with steptrace.phase("build"):
            slot = self._reconcile(slot_id, list(rids))
            out = self.forward(inputs, slot.cache)
        for rid in rids:
            self._seqs[rid].length += 1
        if not self.is_last:
            self._settle(out, lazy)
            return out
        if logits:
            return self._logits(out)
        return self._sample(out[:, -1, :], [self._seqs[r] for r in rids], lazy)

    @staticmethod
    def _settle(arrays: Any, lazy: bool) -> None:
        """Evaluate ``arrays`` (a non-last slice's output, or a chunk's cache), or with ``lazy`` queue them with
        ``mx.async_eval``, so that the caller builds its next step while the device runs this one (reading
        them later waits)."""
        if lazy:
            with steptrace.phase("build"):  # queueing encodes the step's kernels on this thread
                mx.async_eval(arrays)
            return
        with steptrace.phase("device"):
            mx.eval(arrays)

    @staticmethod
    def _logits(out: mx.array) -> mx.array:
        """Last-position logits as float32 [B, V] (the full-logits return)."""
        x = out[:, -1, :].astype(mx.float32)
        mx.eval(x)
        return x

    def _sample(self, logits: mx.array, seqs: list[_Seq], lazy: bool = False) -> list[Sampled] | PendingSample:
        rows = [s.row or RowSampler(SamplingParams()) for s in seqs]
        if not lazy:
            return sample_rows(logits, rows)
        with steptrace.phase("build"):
            pending = sample_lazy(logits, rows)
            mx.async_eval(pending.arrays)
        return pending

    # -- slots -----------------------------------------------------------------------------

    def _require(self, rid: str) -> _Seq:
        seq = self._seqs.get(rid)
        if seq is None:
            raise RunnerError(ErrorCode.NOT_FOUND, f"request {rid} was not prepared on this stage")
        return seq

    def _reconcile(self, slot_id: int, rids: list[str]) -> _Slot:
        """Make slot ``slot_id`` hold exactly ``rids``: drop rows it no longer names, append new ones."""
        slot = self._slots.setdefault(slot_id, _Slot())
        if slot.rids == rids:
            return slot
        wanted = set(rids)
        if len(wanted) != len(rids):
            raise RunnerError(ErrorCode.BAD_REQUEST, "a request id appears twice in one micro-batch")
        keep = [r for r in slot.rids if r in wanted]
        new = rids[len(keep):]
        if keep != rids[: len(keep)] or any(r in keep for r in new):
            raise RunnerError(ErrorCode.BAD_REQUEST, f"micro-batch {slot_id}: rows out of order (expected {keep} first)")
        joining = [self._require(r) for r in new]
        for seq in joining:
            if seq.slot is not None:
                raise RunnerError(ErrorCode.BAD_REQUEST, f"request {seq.rid} already decodes in micro-batch {seq.slot}")
        if len(keep) != len(slot.rids):
            for i, r in enumerate(slot.rids):
                if r not in wanted and r in self._seqs:
                    if self.keep_dropped:  # ends with the step in flight: its release (and prefix entry) follows
                        seq = self._seqs[r]
                        seq.cache, seq.slot = self._row_cache(slot, i), None
                    else:
                        del self._seqs[r]  # dropped by the coordinator: finished or cancelled
            self._filter(slot, [i for i, r in enumerate(slot.rids) if r in wanted])
        if joining:
            self._append(slot, joining)
        for seq in joining:
            seq.slot, seq.cache = slot_id, None
        return slot

    @staticmethod
    def _row_cache(slot: _Slot, i: int) -> list:
        if len(slot.rids) == 1 and not slot.batched:
            return slot.cache
        return [extract_row(c, i, pads) for c, pads in zip(slot.cache, slot.pads, strict=True)]

    def _filter(self, slot: _Slot, indices: list[int]) -> None:
        slot.rids = [slot.rids[i] for i in indices]
        if not slot.rids:
            slot.cache, slot.batched, slot.pads = [], False, []
        elif slot.batched:
            slot.pads = [filter_rows(c, indices, pads) for c, pads in zip(slot.cache, slot.pads, strict=True)]

    def _append(self, slot: _Slot, joining: list[_Seq]) -> None:
        caches = [s.cache for s in joining]
        if not slot.rids and len(joining) == 1:
            slot.cache = caches[0]  # one row: its own cache, exactly as single-sequence generation
        else:
            layers = [join_layer(slot.cache[k] if slot.rids else None, slot.pads[k] if slot.batched else None,
                                 rows, batched=slot.batched)
                      for k, rows in enumerate(zip(*caches))]
            slot.cache, slot.pads = [c for c, _ in layers], [p for _, p in layers]
            slot.batched = True
        slot.rids = slot.rids + [s.rid for s in joining]
