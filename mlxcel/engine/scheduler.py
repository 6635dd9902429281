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

A request's state is one field, ``_Sequence.state`` (a ``RequestState``), changed only through
``_Sequence.move``, which raises ``IllegalTransition`` (a scheduler bug) for a move not in
``TRANSITIONS``; the scheduler's ``_move`` also keeps the queue of each queued state in order:

    WAITING --admitted--> PREFILLING --last chunk sampled--> JOINING --in a group--> RUNNING
    PREFILLING --every prompt token but the last prefilled (prompt tails batched)--> JOINING
    WAITING --admitted, prefilled elsewhere (cache adopted)--> JOINING
    WAITING, PREFILLING --> FINISHED_ERROR, FINISHED_CANCELLED
    JOINING, RUNNING --> FINISHED_STOPPED (EOS, stop string), FINISHED_LENGTH (max_tokens),
                         FINISHED_ERROR, FINISHED_CANCELLED
    PREFILLING, RUNNING --its step failed with a node failure--> RESUMING --prepared again--> PREFILLING
    RESUMING --> FINISHED_ERROR (no node took it within the bounds), FINISHED_CANCELLED
    WAITING (held: its start failed with a node failure) --the node is back--> PREFILLING
    WAITING (held) --> FINISHED_ERROR (past the resume timeout), FINISHED_CANCELLED

Resuming (``mlxcel.engine.resume``; only over an executor with a ``resume_policy``, the pipeline's): a
sequence whose step failed because a node died, froze or restarted keeps its slot, its text state and
its tokens; it is released on the executor and prepared again, every ``RETRY_S``, with ``prompt +
generated`` as its prompt and its sampler ``len(generated)`` draws on, then prefilled like a new one.
The token sampled after that prefill is its next token: the stream goes on as if nothing happened.

Holding (the same policy, ``mlxcel.engine.holding``): a new request whose start (``prepare``) fails with
such a node failure of the unavailable class (a stage down) stays WAITING, *held*, instead of failing at
once: the head of the queue is tried again every ``RETRY_S`` until a start succeeds (the node restarted,
answered a probe again or was replaced by a spare), then every held request starts in order. Each held
request gives up ``wait_s`` after it was first held, once its failed start came back (the failure's own
code: HTTP 503 + Retry-After). Held requests keep their place in the
bounded queue (``parallel + max_queue``); one whose client goes away is dropped. With resuming off a
failed start ends the request at once, as before.

A sequence enters JOINING before its first token is emitted, so that token can end it. With prompt tails
batched (``batch_tails``: on where scheduling is asynchronous, ``MLXCEL_BATCH_TAILS=1/0`` either way) a
prompt's last token is not a prefill step of its own: once its other tokens are in the cache the sequence
joins a decode group with that token (``todo`` holds it) as its row's input, and the decode step samples
its first token beside the other rows' next ones. Only while other sequences decode: with no decode step to
share, and for a prompt with nothing before its last token to prefill (one token, or all but one cached),
the last token runs alone as before. A finished
state is final; a finished sequence leaves ``_seqs``. ``busy`` (a prompt chunk in flight) and
``group`` (its decode micro-batch) are not states: they say which in-flight step still names it;
both are cleared as that step returns, so a request the step itself ends (its failure included) is
freed on the executor at once, and one that ended while it was in flight is freed then.

Everything but ``submit``/``cancel``/``stats``/``close`` runs on the scheduler thread, which takes
its inputs (new requests, cancellations, finished steps) from one queue, so nothing needs locks.
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, cast

from mlxcel.config import (
    DEFAULT_MAX_QUEUE,
    DEFAULT_PARALLEL,
    DEFAULT_PREFIX_CACHE_MB,
    PREFILL_STEP,
)
from mlxcel import envs
from mlxcel.engine import steptrace
from mlxcel.engine.emitter import Emitter, FinishOut, TokenOut
from mlxcel.engine.executor import PREVIOUS, Executor, Step, StepOutcome
from mlxcel.engine.holding import Hold, start_may_wait
from mlxcel.engine.interface import (
    EngineOverloaded,
    EngineRequest,
    EngineUnavailable,
    EventStream,
    FinishEvent,
    TokenEvent,
)
from mlxcel.engine.prefill_split import prompt_chunk
from mlxcel.engine.resume import RETRY_S as RESUME_RETRY_S
from mlxcel.engine.resume import ResumePolicy
from mlxcel.engine.runner import Sampled
from mlxcel.engine.sampling import SamplingParams, random_seed
from mlxcel.engine.textstream import SequenceText
from mlxcel.error_codes import ErrorCode, code_of

log = logging.getLogger("mlxcel.engine")

IDLE_WAIT_S = 0.5


class Adopter(Protocol):
    """The optional executor hook behind ``Scheduler.submit_prefilled``."""

    def adopt(self, rid: str, params: SamplingParams, top_logprobs: int, cache: Any, length: int) -> None:
        """Install ``cache``, filled elsewhere with ``length`` prompt tokens, as a new sequence's KV cache."""


class RequestState(enum.Enum):
    """Where a request is in the scheduler (the module docstring has the transitions)."""

    WAITING = "waiting"  # queued for a slot (``_waiting``)
    PREFILLING = "prefilling"  # admitted, prompt chunks to run (``_prefilling``)
    JOINING = "joining"  # first token sampled (or, a prompt tail, its last token to run), waiting for a group
    RUNNING = "running"  # a member of decode group ``group``
    RESUMING = "resuming"  # lost to a node failure, waiting to be prepared again (``_resuming``)
    FINISHED_STOPPED = "finished_stopped"  # EOS or a stop string
    FINISHED_LENGTH = "finished_length"  # max_tokens
    FINISHED_ERROR = "finished_error"
    FINISHED_CANCELLED = "finished_cancelled"  # the client went away

    @property
    def finished(self) -> bool:
        return self.name.startswith("FINISHED_")


S = RequestState  # short for the tables and transitions below
_ENDS_EARLY = frozenset({S.FINISHED_ERROR, S.FINISHED_CANCELLED})
_ENDS = _ENDS_EARLY | {S.FINISHED_STOPPED, S.FINISHED_LENGTH}
TRANSITIONS: dict[RequestState, frozenset[RequestState]] = {
    S.WAITING: frozenset({S.PREFILLING, S.JOINING}) | _ENDS_EARLY,
    S.PREFILLING: frozenset({S.JOINING, S.RESUMING}) | _ENDS_EARLY,
    S.JOINING: frozenset({S.RUNNING}) | _ENDS,
    S.RUNNING: _ENDS | {S.RESUMING},
    S.RESUMING: frozenset({S.PREFILLING}) | _ENDS_EARLY,
    **{end: frozenset() for end in _ENDS},
}
_FINISHED_BY_REASON = {"stop": S.FINISHED_STOPPED, "length": S.FINISHED_LENGTH, "error": S.FINISHED_ERROR}


class IllegalTransition(RuntimeError):
    """A request was moved to a state ``TRANSITIONS`` does not allow from its own: a scheduler bug."""


@dataclass(frozen=True)
class _Handoff:
    """What a prefill node produced: the KV cache of the whole prompt and the token sampled after it."""

    first: Sampled
    cache: Any


@dataclass(eq=False)
class _Sequence:
    request: EngineRequest
    stream: Any  # EventStream (or a sink during warmup)
    text: SequenceText
    offthread: bool = False  # its text is assembled on the emitter thread (no stop strings to decide on)
    todo: list[int] = field(default_factory=list)  # prompt tokens not yet prefilled (JOINING: the batched tail)
    generated: list[int] = field(default_factory=list)
    group: int | None = None  # decode micro-batch, once RUNNING
    busy: bool = False  # a prefill step of it is in flight
    decoding: int = 0  # decode steps naming it in flight (2 while the next is queued behind the current)
    handoff: _Handoff | None = None  # prefilled elsewhere: adopted on admission instead of prefilled
    state: RequestState = RequestState.WAITING
    params: SamplingParams | None = None  # the request's, its seed resolved where a resume must replay it
    resumes: int = 0  # times it was resumed after a node failure
    resume_deadline: float = 0.0  # while RESUMING: give up at this time (monotonic)
    resume_next: float = 0.0  # while RESUMING: the next try
    resume_error: BaseException | None = None  # while RESUMING: the failure, or the last try's
    arrived: float = field(default_factory=time.monotonic)  # when it was queued
    held_since: float = 0.0  # while WAITING and held (its start failed with a node failure): since when

    @property
    def rid(self) -> str:
        return self.request.request_id

    def move(self, to: RequestState) -> RequestState:
        """Enter state ``to``; returns the state left. ``IllegalTransition`` if ``TRANSITIONS`` forbids it."""
        if to not in TRANSITIONS[self.state]:
            raise IllegalTransition(f"request {self.rid}: {self.state.name} -> {to.name} is not a transition")
        was, self.state = self.state, to
        return was


@dataclass
class EngineCounters:
    """Monotonic counters and current gauges, read by /metrics and tests."""

    decode_steps: int = 0
    decode_rows: int = 0  # sum over steps of sequences decoded in that step
    shared_steps: int = 0  # steps that decoded two or more sequences
    max_rows: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    adopted: int = 0  # sequences admitted with a KV cache filled elsewhere (submit_prefilled)
    running: int = 0  # sequences admitted (prefilling or decoding)
    decoding: int = 0  # rows of the last decode step
    waiting: int = 0  # queued, not yet admitted
    inflight_steps: int = 0
    overlapped_steps: int = 0  # steps submitted while another was in flight (micro-batching at work)
    failed_steps: int = 0
    resumed: int = 0  # sequences prepared again after a node failure and continued (mlxcel/engine/resume.py)
    resume_failed: int = 0  # sequences that waited to resume and failed: bounds spent, no node took them
    held: int = 0  # new requests held now: their start waits for a node to be back (gauge)
    holds: int = 0  # new requests ever held
    hold_failed: int = 0  # held requests that failed: no node within the resume timeout


class Scheduler:
    """The ``Engine`` the HTTP front talks to, over any ``Executor``."""

    def __init__(self, executor: Executor, tokenizer: Any, *, context_length: int, parallel: int = DEFAULT_PARALLEL,
                 max_queue: int = DEFAULT_MAX_QUEUE, prefill_step: int = PREFILL_STEP, warmup: bool = True,
                 resume: ResumePolicy | None = None, batch_tails: bool | None = None):
        self.executor = executor
        policy = resume if resume is not None else getattr(executor, "resume_policy", None)
        self.resume = policy if policy is not None and policy.enabled else None
        self._tokenizer = tokenizer
        self._context_length = context_length
        self.parallel = parallel
        self.max_batch_size = executor.micro_batch_size * executor.depth
        self._fill = bool(getattr(executor, "fill_micro_batches", False))
        self.max_queue = max_queue
        self.prefill_step = prefill_step
        self._warmup = warmup
        self._eos = set(tokenizer.eos_token_ids)
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._inflight_requests = 0
        self._closed = False
        self._ready = threading.Event()
        self._seqs: dict[str, _Sequence] = {}
        self._waiting: deque[_Sequence] = deque()
        self._prefilling: deque[_Sequence] = deque()
        self._joining: deque[_Sequence] = deque()  # first token sent, waiting for a group
        self._resuming: deque[_Sequence] = deque()  # lost to a node failure, to be prepared again
        self._queues: dict[RequestState, deque[_Sequence]] = {  # the queued states, each in arrival order
            S.WAITING: self._waiting, S.PREFILLING: self._prefilling, S.JOINING: self._joining,
            S.RESUMING: self._resuming}
        self._groups: list[list[str]] = [[] for _ in range(executor.depth)]
        # decode steps in flight per group: at most 1, or 1 + lookahead over an asynchronous executor
        self._group_inflight = [0] * executor.depth
        start_async = getattr(executor, "start_async", None)  # asynchronous scheduling: steps complete via poll
        self._lookahead = int(start_async()) if callable(start_async) else 0
        self._poll = getattr(executor, "poll", None) if self._lookahead else None
        self.batch_tails = batch_tails_default(self._lookahead) if batch_tails is None else batch_tails
        # with asynchronous scheduling, detokenization and delivery run on their own thread (engine/emitter.py)
        self._emitter = Emitter() if self._lookahead else None
        self._outbox: list[TokenOut | FinishOut] = []  # this pass's events for the emitter, sent as one batch
        self._steps_inflight = 0
        self._deferred: list[tuple[str, list[int] | None, int | None, bool]] = []  # (rid, tokens, slot or None, cancelled)
        self._last_kind = "decode"
        self._hold = Hold(self.resume.wait_s if self.resume is not None else 0.0)  # new requests held now
        self._last_prefilled: str | None = None  # the sequence of the last prompt chunk submitted
        self.counters = EngineCounters()
        self._trace = steptrace.from_env()  # MLXCEL_STEP_TRACE: a per-pass timeline of this thread
        self._thread = threading.Thread(target=self._run, name="mlxcel-scheduler", daemon=True)

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
        if not callable(getattr(self.executor, "adopt", None)):
            raise TypeError(f"{type(self.executor).__name__} has no adopt method: it cannot take prefilled sequences")
        if not request.prompt:
            raise ValueError("a prefilled sequence needs the prompt its cache was filled with")
        return self._enqueue(request, _Handoff(first, cache))

    def _enqueue(self, request: EngineRequest, handoff: _Handoff | None) -> EventStream:
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
        self._flush_outbox()
        if self._emitter is not None:
            self._emitter.close()

    def _turn(self) -> bool:
        """One pass of the loop; False when told to stop. A bug raised here fails the requests open at
        that moment (500) instead of ending the thread and hanging every request after it."""
        try:
            if not self._handle(block=self._idle() and not self._pollable()):
                self._end_trace_pass()  # the steps applied before the stop still get their line
                return False
            self._flush_outbox()  # the tokens just applied go out while the device runs the next step
            self._resume_due()
            self._admit()
            self._submit_work()
            self._flush_outbox()
            self._pump()
            self._end_trace_pass()
        except Exception as exc:  # noqa: BLE001 - the scheduler thread must outlive any one step's bug
            log.exception("scheduler: internal error; failing the requests in flight")
            try:
                self._fail_all(f"internal error in the scheduler: {exc}")
                self._flush_outbox()
            except Exception:  # noqa: BLE001 - nothing left to fail them with; keep serving new ones
                log.exception("scheduler: could not fail the requests in flight")
        return True

    def _end_trace_pass(self) -> None:
        if self._trace is not None:
            self._trace.end_pass(running=len(self._seqs) - len(self._waiting), waiting=len(self._waiting))

    def _flush_outbox(self) -> None:
        if self._outbox:
            assert self._emitter is not None
            with steptrace.phase("emit"):
                self._emitter.send(self._outbox)
            self._outbox = []

    def _pollable(self) -> bool:
        """Steps are queued on an asynchronous executor: they complete through ``poll``, not on their own."""
        return self._poll is not None and self._steps_inflight > 0

    def _pump(self) -> None:
        """Wait for the oldest queued step of an asynchronous executor (its ``done`` fills the inbox); the
        step after it is queued already, so the device works on while this thread applies the result."""
        if self._pollable():
            assert self._poll is not None
            self._poll()

    def _idle(self) -> bool:
        """Nothing to do but wait for an input: a step in flight, no request, or only resumes not due yet."""
        if self._steps_inflight > 0 or not self._seqs:
            return True
        now = time.monotonic()
        busy = (self._prefilling or self._joining or any(self._groups)
                or (self._waiting and self._admitted() < self.parallel and self._hold.due(now)))
        return not busy and all(seq.resume_next > now for seq in self._resuming)

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
        """Run tiny sequences through prefill and batched decode so the first request is not slow.

        With a chat template the first prompt is a templated dummy chat: its KV seeds the prefix
        cache with the template's preamble, which every chat request shares.
        """
        start = time.perf_counter()
        prompts = [self._template_preamble() or [1, 2, 3, 4], [5, 6, 7]]
        for prompt in prompts:
            req = EngineRequest(tuple(prompt), SamplingParams(max_tokens=2), ignore_eos=True)
            self._add(_Sink(req))
        with self._lock:
            self._inflight_requests += len(prompts)
        self._admit()
        self._submit_work()
        while self._seqs or self._steps_inflight:  # a queued step past the warmup's end is drained too
            self._pump()
            self._handle(block=not self._pollable())
            self._admit()
            self._submit_work()
        self._flush_outbox()
        self.counters = EngineCounters()  # warmup is not traffic
        if self._trace is not None:
            self._trace.discard()
        log.info("warmup done in %.2fs", time.perf_counter() - start)

    def _template_preamble(self) -> list[int] | None:
        from mlxcel.engine.prompts import encode_chat, has_chat_template

        if not has_chat_template(self._tokenizer):
            return None
        try:
            return encode_chat(self._tokenizer, [{"role": "user", "content": "Hi"}])
        except Exception:  # a template that needs more than a user turn: no seed, no harm
            return None

    # -- admission -------------------------------------------------------------------------------

    def _add(self, stream: Any, handoff: _Handoff | None = None) -> None:
        req = stream.request
        if getattr(stream, "cancelled", False):
            self._release_slot()
            return
        params = req.params
        if self.resume is not None and not params.greedy and params.seed is None:
            params = replace(params, seed=random_seed())  # a resume replays the same random stream
        seq = _Sequence(req, stream, SequenceText(self._tokenizer, req.params.stop), handoff=handoff, params=params,
                        offthread=self._emitter is not None and not req.params.stop)
        self._seqs[req.request_id] = seq
        self._waiting.append(seq)
        if self._hold.active:  # the executor cannot start requests now: this one is held from its arrival
            self._held(seq, seq.arrived)
        self._gauges()

    def _admit(self) -> None:
        """Give waiting requests a slot: room on the executor, then a place in the prefill queue."""
        now = time.monotonic()
        if self._hold.active:
            self._expire_held(now)
        while self._waiting and self._admitted() < self.parallel and self._hold.due(now):
            seq = self._waiting[0]
            req = seq.request
            try:
                cached = self._prepare(seq)
            except Exception as exc:
                if self._may_hold(seq, exc):
                    self._hold_all(exc)
                    break
                log.warning("cannot start request %s: %s", seq.rid, exc)
                self._finish(seq, "error", error=str(exc), code=code_of(exc))
                continue
            if self._hold.active:
                self._unhold()
            if seq.handoff is not None:
                self._adopted(seq)
                continue
            seq.todo = list(req.prompt[cached:])
            self._move(seq, S.PREFILLING)
            self.counters.prompt_tokens += len(req.prompt)
        self._gauges()

    def _prepare(self, seq: _Sequence) -> int:
        """Make room on the executor; returns how many prompt tokens are already in the cache."""
        req = seq.request
        params = seq.params or req.params
        if seq.handoff is None:
            if req.draws:  # resumed elsewhere (a prefill node re-prefilling for the router): the sampler goes on
                return self.executor.prepare(seq.rid, params, req.top_logprobs, req.prompt, draws=req.draws)
            return self.executor.prepare(seq.rid, params, req.top_logprobs, req.prompt)
        adopter = cast(Adopter, self.executor)
        adopter.adopt(seq.rid, params, req.top_logprobs, seq.handoff.cache, len(req.prompt))
        return len(req.prompt)

    def _adopted(self, seq: _Sequence) -> None:
        """A prefilled-elsewhere sequence has its cache installed: send its first token, then decode."""
        assert seq.handoff is not None
        first, seq.handoff = seq.handoff.first, None  # the cache belongs to the executor now
        self.counters.adopted += 1
        self._move(seq, S.JOINING)
        self._on_token(seq, first)

    def _move(self, seq: _Sequence, to: RequestState) -> RequestState:
        """The one way a request changes state: checked by ``_Sequence.move``, then from the queue of the
        state it left (if any) to the end of the queue of ``to`` (if any); returns the state left."""
        was = seq.move(to)
        if was in self._queues:
            self._queues[was].remove(seq)
        if to in self._queues:
            self._queues[to].append(seq)
        return was

    def _admitted(self) -> int:
        return len(self._seqs) - len(self._waiting)

    def _gauges(self) -> None:
        self.counters.waiting = len(self._waiting)
        self.counters.held = sum(1 for s in self._waiting if s.held_since)
        self.counters.running = self._admitted()
        self.counters.inflight_steps = self._steps_inflight

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
            self._count_decode(len(seqs))
            return Step("decode", [q.rid for q in seqs], tokens, slot=g)
        return None

    def _count_decode(self, rows: int) -> None:
        c = self.counters
        c.decode_steps += 1
        c.decode_rows += rows
        c.shared_steps += rows >= 2
        c.max_rows = max(c.max_rows, rows)
        c.decoding = rows

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
        self._flush_releases(step)
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
            if self._may_resume(seq, exc):
                self._suspend(seq, exc)
            else:
                self._finish(seq, "error", error=message, code=code_of(exc))
        if step.kind == "decode":
            self._groups[step.slot] = [r for r in self._groups[step.slot] if r in self._seqs]

    def _on_token(self, seq: _Sequence, sampled: Sampled) -> bool:
        """Send one token (or finish on EOS, a stop string, max_tokens); True if the sequence goes on."""
        req = seq.request
        token = sampled.token
        if token in self._eos and not req.ignore_eos:  # EOS is not part of the output
            self._finish(seq, "stop")
            return False
        seq.generated.append(token)
        self.counters.generated_tokens += 1
        if seq.offthread:  # EOS and max_tokens need no text: the emitter thread makes it
            self._outbox.append(TokenOut(seq.stream, seq.text, token, sampled.logprob if req.params.logprobs else None,
                                         sampled.top_logprobs if req.params.logprobs else ()))
            if len(seq.generated) >= req.params.max_tokens:
                self._finish(seq, "length")
                return False
            return True
        with steptrace.phase("detok"):
            text = seq.text.feed(token)
        logprob = sampled.logprob if req.params.logprobs else None
        top = sampled.top_logprobs if req.params.logprobs else ()
        with steptrace.phase("emit"):
            seq.stream.push(TokenEvent(token, text, logprob, top))
        if seq.text.stopped:
            self._finish(seq, "stop")
            return False
        if len(seq.generated) >= req.params.max_tokens:
            self._finish(seq, "length")
            return False
        return True

    # -- resuming after a node failure (mlxcel/engine/resume.py) ---------------------------------------

    def _may_resume(self, seq: _Sequence, exc: BaseException) -> bool:
        """Whether ``seq``, whose step failed with ``exc``, is resumed instead of failed: the executor says
        the node failure lost its state, its bounds are not spent, it fits the context for a re-prefill."""
        if self.resume is None or self._closed or seq.resumes >= self.resume.max_resumes:
            return False
        resumable = getattr(self.executor, "resumable", None)
        if resumable is None or not resumable(exc):
            return False
        return len(seq.request.prompt) + len(seq.generated) <= self._context_length

    def _suspend(self, seq: _Sequence, exc: BaseException) -> None:
        """Take ``seq`` off the executor (its step just returned, so nothing names it) to resume it."""
        assert self.resume is not None
        was = self._move(seq, S.RESUMING)
        if was is S.RUNNING and seq.group is not None:
            self._groups[seq.group] = [r for r in self._groups[seq.group] if r != seq.rid]
        seq.group, seq.todo = None, []
        seq.resumes += 1
        now = time.monotonic()
        seq.resume_deadline, seq.resume_next, seq.resume_error = now + self.resume.wait_s, now + RESUME_RETRY_S, exc
        log.warning("request %s lost to a node failure after %d tokens (%s); resuming it (%d of at most %d)",
                    seq.rid, len(seq.generated), exc, seq.resumes, self.resume.max_resumes)
        self._release(seq.rid, None)

    def _resume_due(self) -> None:
        """Prepare again every resuming sequence whose try is due; fail those past their deadline."""
        now = time.monotonic()
        due = [s for s in self._resuming if s.resume_next <= now]
        if not due:
            return
        check = getattr(self.executor, "check_peers", None)
        try:
            if check is not None:
                check()  # once per pass: a node that restarted is seen as such before a sequence goes on it
        except Exception as exc:  # noqa: BLE001 - no node for them yet: try again, up to their deadlines
            for seq in due:
                self._not_yet(seq, exc)
            return
        for seq in due:
            try:
                cached = self._prepare_again(seq)
            except Exception as exc:  # noqa: BLE001 - as above
                self._not_yet(seq, exc)
                continue
            full = list(seq.request.prompt) + seq.generated
            seq.todo = full[cached:]
            self._move(seq, S.PREFILLING)
            self.counters.resumed += 1
            log.info("request %s resumed: re-prefilling %d tokens (%d cached)", seq.rid, len(full) - cached, cached)

    def _not_yet(self, seq: _Sequence, exc: BaseException) -> None:
        """A try to resume ``seq`` failed with ``exc``: try again shortly, or fail it past its deadline or
        when the failure is not one to wait for (a PREPARE refused ``not_found``: ``start_may_wait``)."""
        seq.resume_error = exc
        waits = start_may_wait(exc, getattr(self.executor, "resumable", None))
        if time.monotonic() >= seq.resume_deadline or not waits:
            self._resume_failed(seq)
        else:
            seq.resume_next = time.monotonic() + RESUME_RETRY_S

    def _prepare_again(self, seq: _Sequence) -> int:
        """The executor's ``prepare`` with prompt + generated, the sampler past the tokens sampled so far."""
        full = list(seq.request.prompt) + seq.generated
        return self.executor.prepare(seq.rid, seq.params or seq.request.params, seq.request.top_logprobs, full,
                                     draws=len(seq.generated), attempt=seq.resumes)

    def _resume_failed(self, seq: _Sequence) -> None:
        exc = seq.resume_error
        self.counters.resume_failed += 1
        assert self.resume is not None
        log.warning("request %s could not be resumed within %gs: %s", seq.rid, self.resume.wait_s, exc)
        self._finish(seq, "error", error=f"generation failed and could not be resumed: {exc}",
                     code=code_of(exc) if exc is not None else ErrorCode.UNAVAILABLE)

    # -- holding new requests while a node is down (the resume policy's bound) ---------------------------

    def _may_hold(self, seq: _Sequence, exc: BaseException) -> bool:
        """Whether a new request whose start failed with ``exc`` waits for the node instead of failing:
        resuming is on and the failure is a node failure of the unavailable class (``holding.start_may_wait``)."""
        return (self.resume is not None and not self._closed and seq.handoff is None
                and start_may_wait(exc, getattr(self.executor, "resumable", None)))

    def _hold_all(self, exc: BaseException) -> None:
        """The head of the queue could not start: hold every waiting request from now, when the failed start
        came back (a PREPARE nobody answered waited its whole timeout first); try again in ``RETRY_S``."""
        assert self.resume is not None
        now = time.monotonic()
        if self._hold.failed(exc, now):
            log.warning("holding new requests until the pipeline can start them again (%s); each waits at most "
                        "%gs (--resume-timeout)", exc, self.resume.wait_s)
        for seq in self._waiting:
            self._held(seq, now)
        self._expire_held(now)

    def _held(self, seq: _Sequence, now: float) -> None:
        if self._hold.hold(seq, now):
            self.counters.holds += 1

    def _unhold(self) -> None:
        """A start succeeded: the node is back, the held requests start in their order."""
        held = sum(1 for s in self._waiting if s.held_since)
        log.info("the pipeline starts requests again: %d held request(s) go on", held)
        self._hold.end()
        for seq in self._waiting:
            seq.held_since = 0.0

    def _expire_held(self, now: float) -> None:
        """Fail the held requests past their bound (503 + Retry-After); stop holding when none is left."""
        exc = self._hold.error
        for seq in [s for s in self._waiting if self._hold.expired(s, now)]:
            self.counters.hold_failed += 1
            log.warning("request %s held %.1fs and not started: %s", seq.rid, now - seq.held_since, exc)
            self._finish(seq, "error", error=self._hold.message(seq, now),
                         code=code_of(exc) if exc is not None else ErrorCode.UNAVAILABLE)
        if not self._waiting:
            self._hold.end()

    # -- ending requests ---------------------------------------------------------------------------

    def _finish(self, seq: _Sequence, reason: str, error: str | None = None, code: ErrorCode | None = None) -> None:
        """End ``seq`` with ``reason`` ("stop", "length" or "error") and tell its client."""
        if seq.offthread:  # the emitter reads the tail after the tokens it has yet to detokenize
            self._forget(seq, _FINISHED_BY_REASON[reason])
            self._outbox.append(FinishOut(seq.stream, seq.text, FinishEvent(
                reason, "", len(seq.request.prompt), len(seq.generated), error,
                (code or ErrorCode.INTERNAL) if error is not None else None)))
            return
        with steptrace.phase("detok"):
            tail = seq.text.finish() if error is None else ""
        self._forget(seq, _FINISHED_BY_REASON[reason])  # the slot is free before the client hears: no spurious 503
        with steptrace.phase("emit"):
            seq.stream.push(FinishEvent(reason, tail, len(seq.request.prompt), len(seq.generated), error,
                                     (code or ErrorCode.INTERNAL) if error is not None else None))

    def _remove(self, request_id: str) -> None:
        """Drop a cancelled request wherever it is; every copy of its KV cache is freed."""
        seq = self._seqs.get(request_id)
        if seq is not None:
            self._forget(seq, S.FINISHED_CANCELLED)

    def _forget(self, seq: _Sequence, end: RequestState) -> None:
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
                self._deferred.append((seq.rid, tokens, seq.group if not seq.busy else None, cancelled))
            else:
                self._release(seq.rid, tokens, cancelled)
        self._release_slot()
        self._gauges()  # after the slot is free: whoever sees the gauges drop may submit at once

    def _release(self, rid: str, tokens: list[int] | None, cancelled: bool = False) -> None:
        """Free a sequence on the executor: ``cancel`` (when it has one) for a request its client gave up."""
        try:
            cancel = getattr(self.executor, "cancel", None) if cancelled else None
            if cancel is not None:
                cancel(rid)
            else:
                self.executor.release(rid, tokens)
        except Exception as exc:  # a failing stage must not take the scheduler down
            log.warning("releasing %s failed: %s", rid, exc)

    def _flush_releases(self, step: Step) -> None:
        if not self._deferred:
            return
        ready = [d for d in self._deferred
                 if (d[2] is None and step.kind == "prefill" and d[0] == step.rids[0])
                 or (d[2] is not None and step.kind == "decode" and d[2] == step.slot)]
        for item in ready:
            self._deferred.remove(item)
            self._release(item[0], item[1], item[3])

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


class _Sink:
    """The event stream of a warmup sequence: discards everything."""

    cancelled = False

    def __init__(self, request: EngineRequest):
        self.request = request

    def push(self, event: Any) -> None:
        pass


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
