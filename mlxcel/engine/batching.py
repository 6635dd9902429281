"""Continuous batching on one host: a scheduler thread owns the model and mlx-lm's BatchGenerator.

Each loop iteration runs one decode step for every running sequence (at most
``max_batch_size`` rows) and prefills newly admitted prompts in chunks, so a
new request joins the running batch at the next step instead of waiting for
the others to finish. Requests beyond ``parallel`` wait in a bounded queue;
beyond that ``submit`` raises ``EngineOverloaded``. Cancelling a request
removes its row and frees its KV cache at the next loop iteration.

The asyncio side only calls ``submit`` and ``EventStream.cancel``; every other
method runs on the scheduler thread, so the generator needs no locks.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, StopSequences

from mlxcel.engine.interface import (
    EngineOverloaded,
    EngineRequest,
    EngineUnavailable,
    EventStream,
    FinishEvent,
    TokenEvent,
)
from mlxcel.engine.prefix_cache import PrefixCache
from mlxcel.engine.sampling import make_sampler
from mlxcel.engine.textstream import SequenceText

log = logging.getLogger("mlxcel.engine")

PREFILL_STEP = 512  # prompt tokens per prefill chunk; bounds the stall a long prompt causes others
IDLE_WAIT_S = 0.5
PREFIX_CACHE_BYTES = 256 << 20


@dataclass(eq=False)
class _Sequence:
    request: EngineRequest
    stream: EventStream
    text: SequenceText
    uid: int | None = None  # BatchGenerator uid once admitted
    generated: int = 0


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
        self.counters = EngineCounters()
        self.prefix = PrefixCache(prefix_cache_bytes)
        self._gen: BatchGenerator | None = None
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
        self._gen = self._new_generator()
        try:
            if self._warmup:
                self._warm()
        except Exception:  # a model that cannot run fails every request instead of hanging
            log.exception("warmup failed")
        self._ready.set()
        while True:
            if not self._drain(block=not self._seqs):
                break
            if self._by_uid:
                try:
                    self._step()
                except Exception as exc:  # keep serving: fail the batch, start a fresh generator
                    log.exception("decode step failed")
                    self._fail_all(f"generation failed: {exc}")
                    self._gen = self._new_generator()
        self._fail_all("the server is shutting down")
        self._ready.set()
        self._shutdown_generator()

    def _shutdown_generator(self) -> None:
        """Finish queued async work on this thread's stream before the thread ends (else MLX aborts)."""
        stream = self._gen.stream
        self._gen = None
        mx.synchronize(stream)

    def _new_generator(self) -> BatchGenerator:
        return BatchGenerator(
            self.model,
            completion_batch_size=self.max_batch_size,
            prefill_batch_size=self.max_batch_size,
            prefill_step_size=self.prefill_step,
        )

    def _warm(self) -> None:
        """Run tiny sequences through prefill and batched decode so the first request is not slow.

        With a chat template, the first prompt is a templated dummy chat: its cache seeds the prefix
        cache with the template's preamble (system prompt), which every chat request shares.
        """
        start = time.perf_counter()
        prompts = [self._template_preamble() or [1, 2, 3, 4], [5, 6, 7]]
        uids = set(self._gen.insert(prompts, max_tokens=[2, 2]))
        while uids:
            for r in self._gen.next_generated():
                if r.finish_reason is not None:
                    uids.discard(r.uid)
                    self.prefix.store(r.all_tokens, r.prompt_cache)
        self._gen = self._new_generator()
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
                self._remove(arg, reason=None)
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
        while self._waiting and len(self._by_uid) < self.parallel:
            seq = self._waiting.popleft()
            req = seq.request
            sampler = None if req.params.greedy else make_sampler(req.params)  # None: the shared batched argmax
            stops = StopSequences(None if req.ignore_eos else self._eos)
            cache, n = self.prefix.lookup(req.prompt)
            (uid,) = self._gen.insert([list(req.prompt[n:])], max_tokens=[req.params.max_tokens],
                                      caches=[cache] if cache else None, all_tokens=[list(req.prompt[:n])],
                                      samplers=[sampler], stop_sequences=[stops])
            seq.uid = uid
            self._by_uid[uid] = seq
            self.counters.prompt_tokens += len(req.prompt)
        self.counters.waiting = len(self._waiting)
        self.counters.running = len(self._by_uid)

    def _step(self) -> None:
        _, responses = self._gen.next()
        if not responses:
            return
        c = self.counters
        rows = len(responses)
        c.decode_steps += 1
        c.decode_rows += rows
        c.shared_steps += rows >= 2
        c.max_rows = max(c.max_rows, rows)
        c.decoding = rows
        for r in responses:
            seq = self._by_uid.get(r.uid)
            if seq is not None:
                self._on_token(seq, r)
        if not self._by_uid:
            c.decoding = 0
        self._admit()

    def _on_token(self, seq: _Sequence, r: Any) -> None:
        if r.finish_reason == "stop":  # an EOS token: not part of the output
            self.prefix.store(r.all_tokens, r.prompt_cache)
            self._finish(seq, "stop")
            return
        seq.generated += 1
        self.counters.generated_tokens += 1
        text = seq.text.feed(r.token)
        seq.stream.push(TokenEvent(r.token, text, *self._logprobs(seq.request, r)))
        if seq.text.stopped:
            kept = self._gen.remove([r.uid], return_prompt_caches=True)
            if r.uid in kept:
                cache, tokens = kept[r.uid]
                self.prefix.store(tokens, cache)
            self._finish(seq, "stop")
        elif r.finish_reason == "length":
            self.prefix.store(r.all_tokens, r.prompt_cache)
            self._finish(seq, "length")

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

    def _remove(self, request_id: str, reason: str | None) -> None:
        """Drop a cancelled request wherever it is; its KV cache goes with its row."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return
        if seq.uid is not None:
            self._gen.remove([seq.uid])
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


def make_engine_factory(**options: Any) -> Callable[[Any, Any, int], BatchingEngine]:
    """A factory (model, tokenizer, context_length) -> started engine, for the server runtime."""

    def build(model: Any, tokenizer: Any, context_length: int) -> BatchingEngine:
        return BatchingEngine(model, tokenizer, context_length=context_length, **options).start()

    return build
