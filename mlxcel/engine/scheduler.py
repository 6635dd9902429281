"""Continuous batching: a scheduler thread plans steps, an ``Executor`` runs them.

The scheduler owns the requests: admission (``parallel`` slots, a bounded queue beyond them,
``EngineOverloaded`` past that), the prefill budget (prompts go through in chunks of at most
``prefill_step`` tokens, one sequence at a time), decode micro-batches, cancellation, token
emission (text, stop strings, EOS, ``max_tokens``, logprobs) and the prefix-cache policy (which
finished sequences offer their KV for reuse). It never touches a model: each step goes to the
executor, which runs it locally or on pipeline stages and reports back through ``done``.

Decode rows live in ``depth`` micro-batch groups of at most ``micro_batch_size`` rows. A group is
either idle or has one step in flight; whenever fewer than ``depth`` steps are in flight the
scheduler submits the next one, alternating prefill chunks and decode steps so neither starves.
A prefilled sequence sends its first token at once and joins the next idle group with room.
``submit_prefilled`` admits a sequence whose prompt was prefilled elsewhere (a disaggregated prefill
node): once it has a slot, the executor's ``adopt`` installs its KV cache and it goes on exactly as
if it had just been prefilled here.
With the local executor (``depth`` 1) this is one batch decoding every running sequence per step;
with a two-stage pipeline two micro-batches keep both stages busy.

A request's state is one field, ``Seq.state`` (a ``RequestState``), changed only through the request
table's ``move`` (``mlxcel.engine.requests``: the states, ``TRANSITIONS`` and the queue of each queued
state; ``IllegalTransition`` for a move not in the table, a scheduler bug).

Resuming and holding (``mlxcel.engine.resume``, the ``Resumer``; only over an executor with a
``resume_policy``, the pipeline's): a sequence whose step failed because a node died, froze or restarted
goes RESUMING, keeps its slot, text state and tokens, and is prepared again with ``prompt + generated``
(its sampler ``len(generated)`` draws on), then prefilled like a new one: the stream goes on as if nothing
happened. A new request whose start fails with a node failure of the unavailable class stays WAITING,
*held* (``mlxcel.engine.holding``), the head of the queue tried again every ``RETRY_S``, each held one
failing (503 + Retry-After) ``wait_s`` after it was first held. Held requests keep their place in the
bounded queue (``parallel + max_queue``); with resuming off a failed start ends the request at once.

A sequence enters JOINING before its first token is emitted, so that token can end it. With prompt tails
batched (``batch_tails``: on where scheduling is asynchronous, ``MLXCEL_BATCH_TAILS=1/0`` either way) a
prompt's last token is not a prefill step of its own: once its other tokens are in the cache the sequence
joins a decode group with that token (``todo`` holds it) as its row's input, and the decode step samples
its first token beside the other rows' next ones. Only while other sequences decode: with no decode step to
share, and for a prompt with nothing before its last token to prefill (one token, or all but one cached),
the last token runs alone as before. ``busy`` (a prompt chunk in flight) and ``group`` (its decode
micro-batch) are not states: they say which in-flight step still names it; both are cleared as that step
returns, so a request the step itself ends (its failure included) is freed on the executor at once, and
one that ended while it was in flight is freed then (``mlxcel.engine.releases``). Tokens and ends reach
the client through ``mlxcel.engine.outputs``.

Everything but ``submit``/``cancel``/``stats``/``close`` runs on the scheduler thread, which takes
its inputs (new requests, cancellations, finished steps) from one queue, so nothing needs locks.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

from mlxcel import envs
from mlxcel.config import DEFAULT_MAX_QUEUE, DEFAULT_PARALLEL, DEFAULT_PREFIX_CACHE_MB, PREFILL_STEP
from mlxcel.engine import steptrace
from mlxcel.engine.emitter import Emitter
from mlxcel.engine.executor import PREVIOUS, ExecutorBase, Step, StepOutcome
from mlxcel.engine.interface import EngineOverloaded, EngineRequest, EngineUnavailable, EventStream
from mlxcel.engine.outputs import Outputs
from mlxcel.engine.prefill_split import prompt_chunk
from mlxcel.engine.releases import Releases
from mlxcel.engine.requests import FINISHED_BY_REASON, EngineCounters, Handoff, RequestState, RequestTable, Seq
from mlxcel.engine.requests import RequestState as S
from mlxcel.engine.resume import Resumer, ResumePolicy, replayable
from mlxcel.engine.runner import Sampled
from mlxcel.engine.textstream import SequenceText
from mlxcel.engine.warmup import Sink, warmup_requests
from mlxcel.error_codes import ErrorCode, code_of

log = logging.getLogger("mlxcel.engine")

IDLE_WAIT_S = 0.5


class Scheduler:
    """The ``Engine`` the HTTP front talks to, over any executor (an ``ExecutorBase``)."""

    def __init__(self, executor: ExecutorBase, tokenizer: Any, *, context_length: int, parallel: int = DEFAULT_PARALLEL,
                 max_queue: int = DEFAULT_MAX_QUEUE, prefill_step: int = PREFILL_STEP, warmup: bool = True,
                 resume: ResumePolicy | None = None, batch_tails: bool | None = None):
        self.executor = executor
        policy = resume if resume is not None else executor.resume_policy
        self.resume = policy if policy is not None and policy.enabled else None
        self._tokenizer = tokenizer
        self._context_length = context_length
        self.parallel = parallel
        self.max_batch_size = executor.micro_batch_size * executor.depth
        self._fill = executor.fill_micro_batches
        self.max_queue = max_queue
        self.prefill_step = prefill_step
        self._warmup = warmup
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._inflight_requests = 0
        self._closed = False
        self._ready = threading.Event()
        self.table = RequestTable()  # every request, the queue of each queued state (engine/requests.py)
        table = self.table
        self._seqs, self._waiting, self._prefilling = table.seqs, table.waiting, table.prefilling
        self._joining, self._move = table.joining, table.move
        self.resumer = Resumer(table, executor, self.resume, context_length=context_length, finish=self._finish,
                               release=lambda rid: self.releases.now(rid, None))
        self.releases = Releases(executor)  # frees finished sequences on the executor (engine/releases.py)
        self._groups: list[list[str]] = [[] for _ in range(executor.depth)]
        # decode steps in flight per group: at most 1, or 1 + lookahead over an asynchronous executor
        self._group_inflight = [0] * executor.depth
        self._lookahead = int(executor.start_async())  # asynchronous scheduling: steps complete via poll
        self.batch_tails = batch_tails_default(self._lookahead) if batch_tails is None else batch_tails
        # with asynchronous scheduling, detokenization and delivery run on their own thread (engine/emitter.py)
        self.outputs = Outputs(table, set(tokenizer.eos_token_ids), Emitter() if self._lookahead else None)
        self._steps_inflight = 0
        self._last_kind = "decode"
        self._last_prefilled: str | None = None  # the sequence of the last prompt chunk submitted
        self._trace = steptrace.from_env()  # MLXCEL_STEP_TRACE: a per-pass timeline of this thread
        self._thread = threading.Thread(target=self._run, name="mlxcel-scheduler", daemon=True)

    @property
    def counters(self) -> EngineCounters:
        return self.table.counters

    # -- the Engine interface (event loop side) -------------------------------------------------

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def context_length(self) -> int:
        return self._context_length

    def start(self) -> "Scheduler":
        self._thread.start()
        return self

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self._ready.wait(timeout)

    def submit(self, request: EngineRequest) -> EventStream:
        return self._enqueue(request, None)

    def submit_prefilled(self, request: EngineRequest, first: Sampled, cache: Any) -> EventStream:
        """Admit a sequence whose prompt was prefilled elsewhere (the decode side of a disaggregated pair).

        ``cache`` holds the KV of every ``request.prompt`` token (in the executor's format: mlx-lm
        per-layer caches for ``LocalExecutor``) and ``first`` the token sampled after them. It waits for
        a slot like any request (``EngineOverloaded`` past the queue); once admitted, the executor's
        ``adopt`` installs the cache, ``first`` is emitted (EOS, stop strings and ``max_tokens`` apply
        to it) and the sequence joins a decode group. Call from the event loop.
        """
        if not self.executor.adopts:
            raise TypeError(f"{type(self.executor).__name__} has no adopt method: it cannot take prefilled sequences")
        if not request.prompt:
            raise ValueError("a prefilled sequence needs the prompt its cache was filled with")
        return self._enqueue(request, Handoff(first, cache))

    def _enqueue(self, request: EngineRequest, handoff: Handoff | None) -> EventStream:
        with self._lock:
            if self._closed:
                raise EngineUnavailable("the engine is shutting down")
            if self._inflight_requests >= self.parallel + self.max_queue:
                raise EngineOverloaded(
                    f"server is at capacity ({self.parallel} running, {self.max_queue} queued); retry later")
            self._inflight_requests += 1
        stream = EventStream(request, self._cancel)
        self._inbox.put(("add", (stream, handoff)))
        return stream

    def stats(self) -> dict[str, float]:
        c = self.counters
        out = {k: float(v) for k, v in vars(c).items()}
        out.update(self.executor.stats())
        out.update(parallel=self.parallel, max_batch_size=self.max_batch_size,
                   micro_batch_size=self.executor.micro_batch_size, pipeline_depth=self.executor.depth)
        return out

    def health(self) -> dict[str, Any]:
        return self.executor.health()

    def close(self, timeout: float = 10.0) -> None:
        with self._lock:
            self._closed = True
        self._inbox.put(("stop", None))
        if self._thread.is_alive():
            self._thread.join(timeout)
        self.executor.close()

    def _cancel(self, request_id: str) -> None:
        self._inbox.put(("cancel", request_id))

    def _step_done(self, step: Step, outcome: StepOutcome) -> None:
        self._inbox.put(("done", (step, outcome)))

    # -- the scheduler thread ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            if self._warmup:
                self._warm()
        except Exception:  # a model that cannot run fails every request instead of hanging
            log.exception("warmup failed")
            self._fail_all("warmup failed")
        self._ready.set()
        while self._turn():
            pass
        self._fail_all("the server is shutting down", ErrorCode.UNAVAILABLE)
        self.outputs.flush()
        self.outputs.close()

    def _turn(self) -> bool:
        """One pass of the loop; False when told to stop. A bug raised here fails the requests open at
        that moment (500) instead of ending the thread and hanging every request after it."""
        try:
            if not self._handle(block=self._idle() and not self._pollable()):
                self._end_trace_pass()  # the steps applied before the stop still get their line
                return False
            self.outputs.flush()  # the tokens just applied go out while the device runs the next step
            self.resumer.resume_due()
            self._admit()
            self._submit_work()
            self.outputs.flush()
            self._pump()
            self._end_trace_pass()
        except Exception as exc:  # noqa: BLE001 - the scheduler thread must outlive any one step's bug
            log.exception("scheduler: internal error; failing the requests in flight")
            try:
                self._fail_all(f"internal error in the scheduler: {exc}")
                self.outputs.flush()
            except Exception:  # noqa: BLE001 - nothing left to fail them with; keep serving new ones
                log.exception("scheduler: could not fail the requests in flight")
        return True

    def _end_trace_pass(self) -> None:
        if self._trace is not None:
            self._trace.end_pass(running=self.table.admitted(), waiting=len(self._waiting))

    def _pollable(self) -> bool:
        """Steps are queued on an asynchronous executor: they complete through ``poll``, not on their own."""
        return bool(self._lookahead) and self._steps_inflight > 0

    def _pump(self) -> None:
        """Wait for the oldest queued step of an asynchronous executor (its ``done`` fills the inbox); the
        step after it is queued already, so the device works on while this thread applies the result."""
        if self._pollable():
            self.executor.poll()

    def _idle(self) -> bool:
        """Nothing to do but wait for an input: a step in flight, no request, or only resumes not due yet."""
        if self._steps_inflight > 0 or not self._seqs:
            return True
        now = time.monotonic()
        busy = (self._prefilling or self._joining or any(self._groups)
                or (self._waiting and self.table.admitted() < self.parallel and self.resumer.hold.due(now)))
        return not busy and self.resumer.waiting_only(now)

    def _handle(self, *, block: bool) -> bool:
        """Apply queued inputs (blocking for the first one if asked); False when told to stop."""
        try:
            if block:
                with steptrace.phase("idle"):
                    item = self._inbox.get(timeout=IDLE_WAIT_S)
            else:
                item = self._inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            kind, arg = item
            if kind == "stop":
                return False
            if kind == "add":
                self._add(*arg)
            elif kind == "cancel":
                self._remove(arg)
            elif kind == "done":
                self._apply(*arg)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _warm(self) -> None:
        """Run tiny sequences through prefill and batched decode so the first request is not slow
        (``mlxcel.engine.warmup``: the first seeds the prefix cache with a chat template's preamble)."""
        start = time.perf_counter()
        requests = warmup_requests(self._tokenizer)
        for req in requests:
            self._add(Sink(req))
        with self._lock:
            self._inflight_requests += len(requests)
        self._admit()
        self._submit_work()
        while self._seqs or self._steps_inflight:  # a queued step past the warmup's end is drained too
            self._pump()
            self._handle(block=not self._pollable())
            self._admit()
            self._submit_work()
        self.outputs.flush()
        self.table.counters = EngineCounters()  # warmup is not traffic
        if self._trace is not None:
            self._trace.discard()
        log.info("warmup done in %.2fs", time.perf_counter() - start)

    # -- admission -------------------------------------------------------------------------------

    def _add(self, stream: Any, handoff: Handoff | None = None) -> None:
        req = stream.request
        if getattr(stream, "cancelled", False):
            self._release_slot()
            return
        params = replayable(req.params, self.resume)  # a resume replays the same random stream
        seq = Seq(req, stream, SequenceText(self._tokenizer, req.params.stop), handoff=handoff, params=params,
                  offthread=self.outputs.offthread(req.params))
        self.table.add(seq)
        if self.resumer.hold.active:  # the executor cannot start requests now: this one is held from its arrival
            self.resumer.held(seq, seq.arrived)
        self._gauges()

    def _admit(self) -> None:
        """Give waiting requests a slot: room on the executor, then a place in the prefill queue."""
        now = time.monotonic()
        if self.resumer.hold.active:
            self.resumer.expire_held(now)
        while self._waiting and self.table.admitted() < self.parallel and self.resumer.hold.due(now):
            seq = self._waiting[0]
            req = seq.request
            try:
                cached = self._prepare(seq)
            except Exception as exc:
                if not self._closed and self.resumer.may_hold(seq, exc):
                    self.resumer.hold_all(exc)
                    break
                log.warning("cannot start request %s: %s", seq.rid, exc)
                self._finish(seq, "error", error=str(exc), code=code_of(exc))
                continue
            self.resumer.started()
            if seq.handoff is not None:
                self._adopted(seq)
                continue
            seq.todo = list(req.prompt[cached:])
            self._move(seq, S.PREFILLING)
            self.counters.prompt_tokens += len(req.prompt)
        self._gauges()

    def _prepare(self, seq: Seq) -> int:
        """Make room on the executor; returns how many prompt tokens are already in the cache."""
        req = seq.request
        params = seq.params or req.params
        if seq.handoff is None:
            if req.draws:  # resumed elsewhere (a prefill node re-prefilling for the router): the sampler goes on
                return self.executor.prepare(seq.rid, params, req.top_logprobs, req.prompt, draws=req.draws)
            return self.executor.prepare(seq.rid, params, req.top_logprobs, req.prompt)
        self.executor.adopt(seq.rid, params, req.top_logprobs, seq.handoff.cache, len(req.prompt))
        return len(req.prompt)

    def _adopted(self, seq: Seq) -> None:
        """A prefilled-elsewhere sequence has its cache installed: send its first token, then decode."""
        assert seq.handoff is not None
        first, seq.handoff = seq.handoff.first, None  # the cache belongs to the executor now
        self.counters.adopted += 1
        self._move(seq, S.JOINING)
        self._on_token(seq, first)

    def _gauges(self) -> None:
        self.table.gauges(self._steps_inflight)

    # -- planning steps --------------------------------------------------------------------------

    def _submit_work(self) -> None:
        # asynchronous: each group's step N+1 queued behind step N, and a prompt chunk beside them, so new
        # prompts join the batch as fast as with the synchronous alternation
        limit = self.executor.depth + (self._lookahead + 1 if self._lookahead else 0)
        while self._steps_inflight < limit:
            step = self._next_step()
            if step is None:
                return
            self._last_kind = step.kind
            self._last_prefilled = step.rids[0] if step.kind == "prefill" else None
            if self._steps_inflight:
                self.counters.overlapped_steps += 1
            self._steps_inflight += 1
            self.counters.inflight_steps = self._steps_inflight
            if self._trace is not None:
                self._trace.step("submitted", step.kind, step.rows)
            try:
                self.executor.submit(step, self._step_done)
            except Exception as exc:  # noqa: BLE001 - an executor must report failures through done; if it
                # raises instead, the step failed all the same: its requests get the error, their KV is freed
                log.exception("scheduler: the executor raised on submit")
                self._step_done(step, exc)

    def _next_step(self) -> Step | None:
        """Alternate: after a decode step prefer a prompt chunk, after a chunk prefer decoding; but a
        prompt's last token (a step of its own, engine/prefill_split.py) follows its chunk at once, so no
        decode step of the others delays the first token."""
        order = (self._prefill_step, self._decode_step)
        if self._last_kind == "prefill" and not self._last_token_due():
            order = order[::-1]
        if self._lookahead and self._prefilling and self._prefilling[0].busy:
            # a prompt step is queued: keep the synchronous order instead of queueing decode steps ahead of
            # the prompts (after a decode step the prompt's next step; its last token at once; the decode step
            # after its last token takes it along)
            if self._last_kind == "decode" or len(self._prefilling[0].todo) < 2:
                return None
        for plan in order:
            step = plan()
            if step is not None:
                return step
        return None

    def _last_token_due(self) -> bool:
        """The last chunk submitted was of the first prefilling sequence, and only its last token is left."""
        head = self._prefilling[0] if self._prefilling else None
        return head is not None and head.rid == self._last_prefilled and len(head.todo) == 1

    def _prefill_step(self) -> Step | None:
        if not self._prefilling or any(s.busy for s in self._prefilling):
            return None  # one prompt at a time: its chunks are sequential
        seq = self._prefilling[0]
        n = prompt_chunk(len(seq.todo), self.prefill_step)
        chunk, seq.todo = seq.todo[:n], seq.todo[n:]
        seq.busy = True
        return Step("prefill", [seq.rid], [chunk], sample=not seq.todo)

    def _decode_step(self) -> Step | None:
        # Spread rows evenly over the groups (2 streams on 2 stages: one row each, both stages busy), or
        # fill one group before the next (the executor's fill_micro_batches: fewer, fuller steps).
        size = self.executor.micro_batch_size
        rows = sum(len(m) for m in self._groups) + len(self._joining)
        share = size if self._fill else min(size, -(-rows // self.executor.depth))
        target = next((g for g, m in enumerate(self._groups) if len(m) < size), None) if self._fill else None
        for g, inflight in enumerate(self._group_inflight):
            if inflight > self._lookahead:
                continue
            members = self._groups[g]
            members[:] = [r for r in members if r in self._seqs]  # ended while a queued step named them
            while self._joining and len(members) < share and target in (None, g):
                seq = self._joining[0]
                self._move(seq, S.RUNNING)
                seq.group = g
                members.append(seq.rid)
            # with a step of this group in flight (lookahead), a row that step brings to max_tokens sits out
            seqs = [q for q in (self._seqs[r] for r in members)
                    if not q.decoding or len(q.generated) + q.decoding < q.request.params.max_tokens]
            if not seqs:
                continue
            self._group_inflight[g] += 1
            # a row still in the step in flight takes that step's token, read on the device (PREVIOUS)
            tokens = [[PREVIOUS if seq.decoding else seq.todo[0] if seq.todo else seq.generated[-1]] for seq in seqs]
            for seq in seqs:
                seq.decoding += 1
                seq.todo = []  # a batched prompt tail is in this step
            self.counters.count_decode(len(seqs))
            return Step("decode", [q.rid for q in seqs], tokens, slot=g)
        return None

    # -- results ---------------------------------------------------------------------------------

    def _apply(self, step: Step, outcome: StepOutcome) -> None:
        if self._trace is not None:
            self._trace.step("applied", step.kind, step.rows)
        self._steps_inflight -= 1
        self.counters.inflight_steps = self._steps_inflight
        # The step no longer names its sequences: whatever ends them now (its outcome, its failure) frees
        # them at once; those that ended while it was in flight were deferred and are freed here.
        if step.kind == "decode":
            self._group_inflight[step.slot] -= 1
            for rid in step.rids:
                if (seq := self._seqs.get(rid)) is not None:
                    seq.decoding -= 1
        elif (seq := self._seqs.get(step.rids[0])) is not None:
            seq.busy = False
        self.releases.flush(step)
        if isinstance(outcome, BaseException):
            self._step_failed(step, outcome)
            return
        if step.kind == "prefill":
            self._prefilled(step, outcome)
            return
        assert outcome is not None
        for rid, sampled in zip(step.rids, outcome):
            seq = self._seqs.get(rid)
            if seq is not None and seq.group == step.slot:
                self._on_token(seq, sampled)
        self._groups[step.slot] = [r for r in self._groups[step.slot] if r in self._seqs]

    def _prefilled(self, step: Step, outcome: list[Sampled] | None) -> None:
        seq = self._seqs.get(step.rids[0])
        if seq is None:  # cancelled while its chunk was in flight
            return
        if outcome is None:  # an intermediate chunk; the next one follows, or a decode step takes the tail
            if self.batch_tails and len(seq.todo) == 1 and (any(self._groups) or self._joining):
                self._move(seq, S.JOINING)
            return
        self._move(seq, S.JOINING)
        self._on_token(seq, outcome[0])

    def _step_failed(self, step: Step, exc: BaseException) -> None:
        self.counters.failed_steps += 1
        log.warning("%s step of %s failed: %s", step.kind, ", ".join(step.rids), exc)
        message = f"generation failed: {exc}"
        for rid in step.rids:
            seq = self._seqs.get(rid)
            if seq is None:
                continue
            if not self._closed and self.resumer.may_resume(seq, exc):
                self._leave_group(seq)
                self.resumer.suspend(seq, exc)
            else:
                self._finish(seq, "error", error=message, code=code_of(exc))
        if step.kind == "decode":
            self._groups[step.slot] = [r for r in self._groups[step.slot] if r in self._seqs]

    def _on_token(self, seq: Seq, sampled: Sampled) -> bool:
        """Send one token (or finish on EOS, a stop string, max_tokens); True if the sequence goes on."""
        reason = self.outputs.token(seq, sampled)
        if reason is not None:
            self._finish(seq, reason)
        return reason is None

    def _leave_group(self, seq: Seq) -> None:
        """Take a RUNNING sequence out of its decode group (its step returned: nothing names it)."""
        if seq.state is S.RUNNING and seq.group is not None:
            self._groups[seq.group] = [r for r in self._groups[seq.group] if r != seq.rid]

    # -- ending requests ---------------------------------------------------------------------------

    def _finish(self, seq: Seq, reason: str, error: str | None = None, code: ErrorCode | None = None) -> None:
        """End ``seq`` with ``reason`` ("stop", "length" or "error") and tell its client."""
        self.outputs.finish(seq, reason, error, code, lambda: self._forget(seq, FINISHED_BY_REASON[reason]))

    def _remove(self, request_id: str) -> None:
        """Drop a cancelled request wherever it is; every copy of its KV cache is freed."""
        seq = self._seqs.get(request_id)
        if seq is not None:
            self._forget(seq, S.FINISHED_CANCELLED)

    def _forget(self, seq: Seq, end: RequestState) -> None:
        """Move ``seq`` to the finished state ``end`` and free it: its slot, its rows, its KV cache (a
        sequence that stopped or reached its length offers its tokens for the prefix cache)."""
        was = self._move(seq, end)
        self._seqs.pop(seq.rid, None)
        if was is S.RUNNING and seq.group is not None and not self._group_inflight[seq.group]:
            self._groups[seq.group] = [r for r in self._groups[seq.group] if r != seq.rid]
        if was not in (S.WAITING, S.RESUMING):  # a resuming sequence is released already
            keep, cancelled = end in (S.FINISHED_STOPPED, S.FINISHED_LENGTH), end is S.FINISHED_CANCELLED
            tokens = list(seq.request.prompt) + seq.generated if keep else None
            if not self._lookahead and (seq.busy or (seq.group is not None and self._group_inflight[seq.group])):
                # a step naming it is in flight: release after it, so no stage sees it vanish mid-step (an
                # asynchronous executor has built its queued steps already: it frees the row at once, and
                # the queued step's token for it is dropped)
                self.releases.after(seq.rid, tokens, seq.group if not seq.busy else None, cancelled)
            else:
                self.releases.now(seq.rid, tokens, cancelled)
        self._release_slot()
        self._gauges()  # after the slot is free: whoever sees the gauges drop may submit at once

    def _release_slot(self) -> None:
        with steptrace.phase("lock"):
            self._lock.acquire()
        try:
            self._inflight_requests -= 1
        finally:
            self._lock.release()

    def _fail_all(self, message: str, code: ErrorCode = ErrorCode.INTERNAL) -> None:
        for seq in list(self._seqs.values()):
            self._finish(seq, "error", error=message, code=code)
        self.counters.decoding = 0
        self._gauges()


def batch_tails_default(lookahead: int) -> bool:
    """Whether prompt tails ride the decode steps: ``MLXCEL_BATCH_TAILS`` (1/0) if set, else where scheduling
    is asynchronous (``lookahead``: a GPU); ValueError naming the variable for another value."""
    switch = envs.settings().batch_tails
    return bool(lookahead) if switch is None else switch


def local_scheduler(model: Any, tokenizer: Any, *, context_length: int, parallel: int = DEFAULT_PARALLEL,
                    max_batch_size: int | None = None, max_queue: int = DEFAULT_MAX_QUEUE,
                    prefill_step: int = PREFILL_STEP, warmup: bool = True,
                    prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_MB << 20) -> Scheduler:
    """A scheduler over a ``LocalExecutor`` (the whole model in this process)."""
    from mlxcel.engine.executor import LocalExecutor

    executor = LocalExecutor(model, max_batch_size=max_batch_size or parallel,
                             prefix_cache_bytes=prefix_cache_bytes)
    return Scheduler(executor, tokenizer, context_length=context_length, parallel=parallel,
                     max_queue=max_queue, prefill_step=prefill_step, warmup=warmup)
