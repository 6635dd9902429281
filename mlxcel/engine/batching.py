"""Continuous batching on one host: a scheduler thread owns the model and the running decode batch.

Each loop iteration first prefills newly admitted prompts (at most ``prefill_step`` tokens, one
prompt at a time) and sends each finished prompt's first token straight from the prefill's last
logits, then runs one decode step for every running sequence (at most ``max_batch_size`` rows),
the new ones included. So a new request's first token costs the step in flight plus its own
prefill, and it joins the running batch at the next step instead of waiting for the others to
finish. Requests beyond ``parallel`` wait in a bounded queue; beyond that ``submit`` raises
``EngineOverloaded``. Cancelling a request removes its row and frees its KV cache at the next
loop iteration.

The decode batch is mlx-lm's ``GenerationBatch`` (per-row samplers, left-padded ``BatchKVCache``,
one step queued ahead). The asyncio side only calls ``submit`` and ``EventStream.cancel``; every
other method runs on the scheduler thread, so nothing needs locks.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import mlx.core as mx
from mlx_lm.generate import GenerationBatch, StopSequences, generation_stream
from mlx_lm.models.cache import TokenBuffer
from mlx_lm.sample_utils import greedy_sampler

from mlxcel.engine.generate import make_cache
from mlxcel.engine.interface import (
    EngineOverloaded,
    EngineRequest,
    EngineUnavailable,
    EventStream,
    FinishEvent,
    TokenEvent,
)
from mlxcel.engine.prefix_cache import PrefixCache
from mlxcel.engine.sampling import Sampler, SamplingParams, make_sampler
from mlxcel.engine.textstream import SequenceText

log = logging.getLogger("mlxcel.engine")

PREFILL_STEP = 512  # prompt tokens per prefill chunk; bounds the stall a long prompt causes others
IDLE_WAIT_S = 0.5
CLEAR_CACHE_STEPS = 512  # decode steps between releases of MLX's buffer cache (as mlx-lm does)
PREFIX_CACHE_BYTES = 256 << 20


@dataclass(eq=False)
class _Sequence:
    request: EngineRequest
    stream: EventStream
    text: SequenceText
    uid: int | None = None  # set once admitted
    generated: int = 0
    sampler: Sampler | None = None  # None: the batch's shared greedy argmax
    cache: list = field(default_factory=list)  # per-sequence KV cache while prefilling
    todo: list[int] = field(default_factory=list)  # prompt tokens not yet prefilled
    first: tuple[mx.array, mx.array] | None = None  # (token [1], logprobs [V]) sampled by the prefill
    echo: bool = False  # the next decode step reports the first token again: skip it


@dataclass
class EngineCounters:
    """Monotonic counters and current gauges, read by /metrics and tests."""

    decode_steps: int = 0
    decode_rows: int = 0  # sum over steps of sequences decoded in that step
    shared_steps: int = 0  # steps that decoded two or more sequences
    max_rows: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    running: int = 0  # sequences admitted to the generator (prefilling or decoding)
    decoding: int = 0  # rows of the last decode step
    waiting: int = 0  # queued, not yet admitted


class BatchingEngine:
    """The local backend of the ``Engine`` interface."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        context_length: int,
        parallel: int = 4,
        max_batch_size: int | None = None,
        max_queue: int = 64,
        prefill_step: int = PREFILL_STEP,
        warmup: bool = True,
        prefix_cache_bytes: int = PREFIX_CACHE_BYTES,
    ):
        self.model = model
        self._tokenizer = tokenizer
        self._context_length = context_length
        self.parallel = parallel
        self.max_batch_size = max_batch_size or parallel
        self.max_queue = max_queue
        self.prefill_step = prefill_step
        self._warmup = warmup
        self._eos = [[t] for t in sorted(tokenizer.eos_token_ids)]
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._inflight = 0
        self._closed = False
        self._ready = threading.Event()
        self._seqs: dict[str, _Sequence] = {}
        self._by_uid: dict[int, _Sequence] = {}
        self._waiting: deque[_Sequence] = deque()
        self._prefilling: deque[_Sequence] = deque()  # admitted, first token not yet sampled
        self._batch = self._empty_batch()  # the running decode rows
        self._uids = itertools.count()
        self.counters = EngineCounters()
        self.prefix = PrefixCache(prefix_cache_bytes)
        self._thread = threading.Thread(target=self._run, name="mlxcel-scheduler", daemon=True)

    # -- the Engine interface (event loop side) -------------------------------------------------

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def context_length(self) -> int:
        return self._context_length

    def start(self) -> "BatchingEngine":
        self._thread.start()
        return self

    def wait_ready(self, timeout: float | None = None) -> bool:
        """True once the scheduler runs (and warmed up, unless disabled)."""
        return self._ready.wait(timeout)

    def submit(self, request: EngineRequest) -> EventStream:
        with self._lock:
            if self._closed:
                raise EngineUnavailable("the engine is shutting down")
            if self._inflight >= self.parallel + self.max_queue:
                raise EngineOverloaded(
                    f"server is at capacity ({self.parallel} running, {self.max_queue} queued); retry later")
            self._inflight += 1
        stream = EventStream(request, self._cancel)
        self._commands.put(("add", stream))
        return stream

    def stats(self) -> dict[str, float]:
        c = self.counters
        return {
            "decode_steps": c.decode_steps, "decode_rows": c.decode_rows, "shared_steps": c.shared_steps,
            "max_rows": c.max_rows, "prompt_tokens": c.prompt_tokens, "generated_tokens": c.generated_tokens,
            "running": c.running, "decoding": c.decoding, "waiting": c.waiting,
            "prefix_hits": self.prefix.hits, "prefix_tokens": self.prefix.reused_tokens,
            "prefix_bytes": self.prefix.nbytes,
            "parallel": self.parallel, "max_batch_size": self.max_batch_size,
        }

    def close(self, timeout: float = 10.0) -> None:
        with self._lock:
            self._closed = True
        self._commands.put(("stop", None))
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _cancel(self, request_id: str) -> None:
        self._commands.put(("cancel", request_id))

    # -- the scheduler thread ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            if self._warmup:
                self._warm()
        except Exception:  # a model that cannot run fails every request instead of hanging
            log.exception("warmup failed")
            self._fail_all("warmup failed")
            self._reset()
        self._ready.set()
        while True:
            if not self._drain(block=not self._seqs):
                break
            if self._by_uid:
                try:
                    self._step()
                except Exception as exc:  # keep serving: fail the batch, start a fresh one
                    log.exception("decode step failed")
                    self._fail_all(f"generation failed: {exc}")
                    self._reset()
        self._fail_all("the server is shutting down")
        self._ready.set()
        # Finish queued async work on this thread's stream before the thread ends (else MLX aborts).
        mx.synchronize(generation_stream)

    def _empty_batch(self) -> GenerationBatch:
        return GenerationBatch.empty(self.model, greedy_sampler)

    def _reset(self) -> None:
        self._batch = self._empty_batch()
        self._prefilling.clear()

    def _warm(self) -> None:
        """Run tiny sequences through prefill and batched decode so the first request is not slow.

        With a chat template, the first prompt is a templated dummy chat: its cache seeds the prefix
        cache with the template's preamble (system prompt), which every chat request shares.
        """
        start = time.perf_counter()
        prompts = [self._template_preamble() or [1, 2, 3, 4], [5, 6, 7]]
        for prompt in prompts:
            req = EngineRequest(tuple(prompt), SamplingParams(max_tokens=2), ignore_eos=True)
            seq = _Sequence(req, _Discard(), SequenceText(self._tokenizer, ()))
            self._seqs[req.request_id] = seq
            self._waiting.append(seq)
        with self._lock:
            self._inflight += len(prompts)
        self._admit()
        while self._by_uid:
            self._step()
        self.counters = EngineCounters()  # warmup is not traffic
        log.info("warmup done in %.2fs", time.perf_counter() - start)

    def _template_preamble(self) -> list[int] | None:
        from mlxcel.engine.prompts import encode_chat, has_chat_template

        if not has_chat_template(self._tokenizer):
            return None
        try:
            return encode_chat(self._tokenizer, [{"role": "user", "content": "Hi"}])
        except Exception:  # a template that needs more than a user turn: no seed, no harm
            return None

    def _drain(self, *, block: bool) -> bool:
        """Apply queued commands; False when asked to stop."""
        try:
            cmd = self._commands.get(timeout=IDLE_WAIT_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            kind, arg = cmd
            if kind == "stop":
                return False
            if kind == "add":
                self._add(arg)
            elif kind == "cancel":
                self._remove(arg)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
        self._admit()
        return True

    def _add(self, stream: EventStream) -> None:
        req = stream.request
        if stream.cancelled:
            self._release()
            return
        seq = _Sequence(req, stream, SequenceText(self._tokenizer, req.params.stop))
        self._seqs[req.request_id] = seq
        self._waiting.append(seq)
        self.counters.waiting = len(self._waiting)

    def _admit(self) -> None:
        """Give waiting requests a slot: a KV cache (from the longest stored prefix) and a place in the prefill queue."""
        while self._waiting and len(self._by_uid) < self.parallel:
            seq = self._waiting.popleft()
            req = seq.request
            seq.sampler = None if req.params.greedy else make_sampler(req.params)
            cache, n = self.prefix.lookup(req.prompt)
            seq.cache = cache or make_cache(self.model)
            seq.todo = list(req.prompt[n:])
            seq.uid = next(self._uids)
            self._by_uid[seq.uid] = seq
            self._prefilling.append(seq)
            self.counters.prompt_tokens += len(req.prompt)
        self.counters.waiting = len(self._waiting)
        self.counters.running = len(self._by_uid)

    def _step(self) -> None:
        """One loop iteration: prefill (first tokens go out at once), then one decode step for all rows."""
        with mx.stream(generation_stream):
            self._prefill()
            if len(self._batch):
                self._decode()
        if not self._batch.uids:
            self.counters.decoding = 0
        self._admit()

    def _prefill(self) -> None:
        """Prefill admitted prompts one at a time, up to ``prefill_step`` tokens in all.

        The whole remaining prompt goes through the model in one call (the last token included), so
        the first token is sampled from that call's last logits and sent at once; the sequences
        that go on then join the decode batch together. A prompt longer than what is left of the
        budget continues in the next iteration, after a decode step for the others.
        """
        budget = self.prefill_step
        joined: list[_Sequence] = []
        while self._prefilling and budget > 0 and len(self._batch) + len(joined) < self.max_batch_size:
            seq = self._prefilling[0]
            n = min(len(seq.todo), budget)
            budget -= n
            logits = self.model(mx.array(seq.todo[:n], dtype=mx.uint32)[None], cache=seq.cache)
            seq.todo = seq.todo[n:]
            if seq.todo:
                mx.eval([c.state for c in seq.cache])  # the cache only: the unused logits are never computed
                mx.clear_cache()
                break
            self._prefilling.popleft()
            if self._first_token(seq, logits[:, -1, :]):
                joined.append(seq)
        if joined:
            self._batch.extend(self._rows(joined))

    def _first_token(self, seq: _Sequence, logits: mx.array) -> bool:
        """Sample and send the first token; True if the sequence goes on to decode."""
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        y = (seq.sampler or greedy_sampler)(logprobs)
        mx.eval(y, logprobs, [c.state for c in seq.cache])
        mx.clear_cache()
        req = seq.request
        token = int(y.item())
        finish = None
        if token in self._tokenizer.eos_token_ids and not req.ignore_eos:
            finish = "stop"
        elif req.params.max_tokens == 1:
            finish = "length"
        seq.first = (y, logprobs[0])
        return self._on_token(seq, GenerationBatch.Response(
            seq.uid, token, logprobs[0], finish, seq.cache if finish else None, list(req.prompt) if finish else None))

    def _rows(self, seqs: list[_Sequence]) -> GenerationBatch:
        """Prefilled sequences as decode rows whose next input is their first token.

        ``GenerationBatch.__init__`` would run a forward pass for its inputs at once, alone; these
        rows wait for the next shared decode step instead, so the state that constructor leaves
        behind is set here (mlx-lm 0.32's fields). That step reports the first token again
        (``echo``), since it is the token it feeds.
        """
        rows = GenerationBatch.empty(self.model, greedy_sampler)
        rows.uids = [s.uid for s in seqs]
        rows.prompt_cache = [layers[0].merge(list(layers)) for layers in zip(*(s.cache for s in seqs))]
        rows.tokens = [list(s.request.prompt) for s in seqs]
        rows.samplers = [s.sampler for s in seqs]
        rows.logits_processors = [() for _ in seqs]
        rows.stop_sequences = [StopSequences(None if s.request.ignore_eos else self._eos) for s in seqs]
        rows.max_tokens = [s.request.params.max_tokens for s in seqs]
        rows._next_tokens = mx.concatenate([s.first[0] for s in seqs])
        rows._next_logprobs = [s.first[1] for s in seqs]
        rows._token_context = [TokenBuffer(t) for t in rows.tokens]
        rows._num_tokens = [0] * len(seqs)
        rows._matchers = [stops.matcher() for stops in rows.stop_sequences]
        for s in seqs:
            s.cache, s.first, s.echo = [], None, True
        return rows

    def _decode(self) -> None:
        responses = self._batch.next()
        c = self.counters
        rows = len(responses)
        c.decode_steps += 1
        c.decode_rows += rows
        c.shared_steps += rows >= 2
        c.max_rows = max(c.max_rows, rows)
        c.decoding = rows
        if c.decode_steps % CLEAR_CACHE_STEPS == 0:
            mx.clear_cache()
        for r in responses:
            seq = self._by_uid.get(r.uid)
            if seq is None:
                continue
            if seq.echo:  # the first token, already sent by the prefill
                seq.echo = False
                continue
            self._on_token(seq, r)

    def _on_token(self, seq: _Sequence, r: Any) -> bool:
        """Send one token (or finish on EOS, a stop string, max_tokens); True if the sequence goes on."""
        if r.finish_reason == "stop":  # an EOS token: not part of the output
            self.prefix.store(r.all_tokens, r.prompt_cache)
            self._finish(seq, "stop")
            return False
        seq.generated += 1
        self.counters.generated_tokens += 1
        text = seq.text.feed(r.token)
        seq.stream.push(TokenEvent(r.token, text, *self._logprobs(seq.request, r)))
        if seq.text.stopped:
            self._drop_row(seq, keep_cache=True)
            self._finish(seq, "stop")
            return False
        if r.finish_reason == "length":
            self.prefix.store(r.all_tokens, r.prompt_cache)
            self._finish(seq, "length")
            return False
        return True

    def _drop_row(self, seq: _Sequence, *, keep_cache: bool = False) -> None:
        """Take the sequence's row out of the decode batch (or its prefill state), optionally into the prefix cache."""
        if seq.uid in self._batch.uids:
            i = self._batch.uids.index(seq.uid)
            if keep_cache:
                self.prefix.store(self._batch.tokens[i], self._batch.extract_cache(i))
            self._batch.filter([j for j in range(len(self._batch.uids)) if j != i])
        else:
            if keep_cache and not seq.todo:
                self.prefix.store(seq.request.prompt, seq.cache)
            if seq in self._prefilling:
                self._prefilling.remove(seq)
        seq.cache = []

    @staticmethod
    def _logprobs(req: EngineRequest, r: Any) -> tuple[float | None, tuple[tuple[int, float], ...]]:
        if not req.params.logprobs:
            return None, ()
        row = r.logprobs
        if req.top_logprobs <= 0:
            return float(row[r.token].item()), ()
        k = min(req.top_logprobs, row.shape[-1])
        top = mx.argpartition(-row, kth=k - 1)[:k]
        values = row[top]
        pairs = sorted(zip(top.tolist(), values.tolist()), key=lambda p: -p[1])
        return float(row[r.token].item()), tuple((int(t), float(v)) for t, v in pairs)

    def _finish(self, seq: _Sequence, reason: str, error: str | None = None) -> None:
        tail = seq.text.finish() if error is None else ""
        seq.stream.push(FinishEvent(reason, tail, len(seq.request.prompt), seq.generated, error))
        self._forget(seq)

    def _remove(self, request_id: str) -> None:
        """Drop a cancelled request wherever it is; its KV cache goes with its row."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return
        if seq.uid is not None:
            self._drop_row(seq)
        else:
            self._waiting.remove(seq)
        self._forget(seq)

    def _forget(self, seq: _Sequence) -> None:
        self._seqs.pop(seq.request.request_id, None)
        if seq.uid is not None:
            self._by_uid.pop(seq.uid, None)
        self.counters.running = len(self._by_uid)
        self.counters.waiting = len(self._waiting)
        self._release()

    def _release(self) -> None:
        with self._lock:
            self._inflight -= 1

    def _fail_all(self, message: str) -> None:
        for seq in list(self._seqs.values()):
            self._finish(seq, "error", error=message)
        self._waiting.clear()
        self.counters.waiting = self.counters.running = self.counters.decoding = 0


class _Discard:
    """The event sink of warmup sequences."""

    def push(self, event: Any) -> None:
        pass


def make_engine_factory(**options: Any) -> Callable[[Any, Any, int], BatchingEngine]:
    """A factory (model, tokenizer, context_length) -> started engine, for the server runtime."""

    def build(model: Any, tokenizer: Any, context_length: int) -> BatchingEngine:
        return BatchingEngine(model, tokenizer, context_length=context_length, **options).start()

    return build
