"""``TPExecutor``: rank 0's executor; every step is sent to the followers, then run on rank 0's shard.

The scheduler drives it like ``LocalExecutor`` (depth 1, one batched decode of every running row per
step). One worker thread applies prepare, step and release in the order the scheduler made them,
each first sent to the followers over the control channel, so every rank holds the same sequences in
the same rows and evaluates the same collectives. ``prepare`` agrees on the cached prompt prefix with
the followers (each keeps its own prefix cache of its KV shard): every rank starts from the shortest.

Failure: a collective that raises (a rank died: the ring reports the lost peer), a step that runs
longer than ``step_timeout`` (a rank hangs), or a follower that stops answering the probe makes the
group unusable. ``fail`` then completes the step in flight and every later one with ``UNAVAILABLE``
(HTTP 503), reports ``failed`` in ``health`` and calls ``on_fatal`` once, which ends the process.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Sequence

from mlxcel.engine.executor import Done, ExecutorBase, ExecutorError, Step, batching_health, cap_rows
from mlxcel.engine.runner import RowSampler, RunnerError
from mlxcel.engine.sampling import SamplingParams
from mlxcel.error_codes import ErrorCode
from mlxcel.parallel.control import RankZeroControl, encode
from mlxcel.parallel.replay import ShardRunner, agreed_prefix

log = logging.getLogger("mlxcel.parallel")

WAIT_SLICE_S = 0.1


class TPExecutor(ExecutorBase):
    """Rank 0 of a tensor-parallel group as the scheduler's executor."""

    depth = 1

    def __init__(self, model: Any, control: RankZeroControl, *, max_batch_size: int, prefix_cache_bytes: int,
                 step_timeout: float, on_fatal: Callable[[str], None]):
        self.one_row = cap_rows(model)  # caches that cannot merge: one row per decode step (docs/models.md)
        max_batch_size = 1 if self.one_row is not None else max_batch_size
        self.micro_batch_size = max_batch_size
        self.control = control
        self.shard = ShardRunner(model, head=True, max_rows=max_batch_size, prefix_cache_bytes=prefix_cache_bytes)
        self.step_timeout = step_timeout
        self._on_fatal = on_fatal
        self.error: str | None = None
        self.steps = 0
        self._ops: queue.SimpleQueue[tuple[Callable[[], Any], Future | None]] = queue.SimpleQueue()
        self._busy_since: float | None = None
        self._inflight: tuple[Step, Done] | None = None
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        control.on_lost = self.fail
        self._worker = threading.Thread(target=self._work, name="mlxcel-tp-rank0", daemon=True)
        self._watch = threading.Thread(target=self._watchdog, name="mlxcel-tp-watchdog", daemon=True)
        self._worker.start()
        self._watch.start()

    # -- the Executor interface (scheduler thread) ------------------------------------------

    def prepare(self, rid: str, params: SamplingParams, top_logprobs: int, prompt: Sequence[int]) -> int:
        return self._call(lambda: self._prepare(rid, params, top_logprobs, list(prompt)))

    def submit(self, step: Step, done: Done) -> None:
        if self.error is not None:
            done(step, self._unavailable())
            return
        self._ops.put((lambda: self._step(step, done), None))

    def release(self, rid: str, tokens: Sequence[int] | None = None) -> None:
        if self.error is None:
            kept = None if tokens is None else list(tokens)
            self._ops.put((lambda: self._release(rid, kept), None))

    def stats(self) -> dict[str, float]:
        p = self.shard.prefix
        return {"prefix_hits": p.hits, "prefix_tokens": p.reused_tokens, "prefix_bytes": p.nbytes,
                "tp_size": self.control.size, "tp_steps": self.steps}

    def health(self) -> dict[str, Any]:
        if self.error is not None:
            return {"status": "failed", "error": self.error, "tp_size": self.control.size}
        return {**batching_health(self.one_row), "tp_size": self.control.size}

    def close(self) -> None:
        """Tell the followers to stop (after the work queued before), then stop the worker."""
        if self.error is None:
            self._ops.put((self._shutdown, None))
            self._worker.join(self.step_timeout)
        self._stopped.set()

    # -- the worker thread ----------------------------------------------------------------------

    def _call(self, fn: Callable[[], Any]) -> Any:
        if self.error is not None:
            raise self._unavailable()
        fut: Future = Future()
        self._ops.put((fn, fut))
        while True:
            try:
                return fut.result(WAIT_SLICE_S)
            except TimeoutError:
                if self.error is not None:
                    raise self._unavailable() from None

    def _work(self) -> None:
        while not self._stopped.is_set():
            fn, fut = self._ops.get()
            if self.error is not None:
                if fut is not None:
                    fut.set_exception(self._unavailable())
                continue
            self._busy_since = time.monotonic()
            try:
                result = fn()
            except RunnerError as exc:  # refused before any collective; the followers refuse it too
                if fut is not None:
                    fut.set_exception(exc)
            except Exception as exc:  # noqa: BLE001 - a collective or the control channel broke
                self.fail(f"tensor-parallel group failed: {exc}")
                if fut is not None:
                    fut.set_exception(self._unavailable())
            else:
                if fut is not None:
                    fut.set_result(result)
            finally:
                self._busy_since = None
            if fn == self._shutdown:
                return

    def _prepare(self, rid: str, params: SamplingParams, top_logprobs: int, prompt: list[int]) -> int:
        cache, n = self.shard.lookup(prompt)
        replies = self.control.request_all(encode("prepare", rid=rid, prompt=prompt, limit=n))
        counts = {rank: int(r.get("cached", 0)) for rank, r in replies.items()}
        agreed = agreed_prefix([n, *counts.values()])
        if agreed != n:
            cache, n = self.shard.lookup(prompt, limit=agreed) if agreed else (None, 0)
        again = [rank for rank, c in counts.items() if c != agreed]
        if again:
            self.control.request_all(encode("prepare", rid=rid, prompt=prompt, limit=agreed), ranks=again)
        self.shard.prepare(rid, RowSampler(params, top_logprobs, context=prompt), cache, n)
        return n

    def _step(self, step: Step, done: Done) -> None:
        with self._lock:
            self._inflight = (step, done)
        self.control.broadcast(encode("step", kind=step.kind, rids=step.rids, tokens=step.tokens, slot=step.slot,
                                      sample=step.sample))
        try:
            outcome: Any = self.shard.run(step.kind, step.rids, step.tokens, step.slot, step.sample)
        except RunnerError as exc:
            outcome = exc
        self.steps += 1
        if self._take_inflight(step):
            done(step, outcome)

    def _release(self, rid: str, tokens: list[int] | None) -> None:
        self.control.broadcast(encode("release", rid=rid, tokens=tokens))
        self.shard.release(rid, tokens)

    def _shutdown(self) -> None:
        self.control.broadcast(encode("shutdown", reason="rank 0 is stopping"))
        self.shard.close()

    # -- failure --------------------------------------------------------------------------------

    def _take_inflight(self, step: Step) -> bool:
        """True for whoever completes ``step`` first (the worker, or ``fail``)."""
        with self._lock:
            if self._inflight is None or self._inflight[0] is not step:
                return False
            self._inflight = None
            return True

    def _unavailable(self) -> ExecutorError:
        return ExecutorError(f"the tensor-parallel group is down: {self.error}", ErrorCode.UNAVAILABLE)

    def fail(self, message: str) -> None:
        """The group is unusable: fail the step in flight and all later work, then ``on_fatal`` (once)."""
        with self._lock:
            if self.error is not None:
                return
            self.error = message
            inflight, self._inflight = self._inflight, None
        log.error("%s", message)
        if inflight is not None:
            step, done = inflight
            done(step, self._unavailable())
        self._on_fatal(message)

    def _watchdog(self) -> None:
        while not self._stopped.wait(WAIT_SLICE_S * 5):
            since = self._busy_since
            if since is not None and time.monotonic() - since > self.step_timeout and self.error is None:
                self.fail(f"a tensor-parallel step took longer than {self.step_timeout:g}s: a rank hangs")
                return
