"""Resuming a request whose node failed mid-stream, and holding new requests while a node is down.

A request in flight holds everything needed to go on after the node (a pipeline stage, a decode
node) that held its KV cache died, froze or restarted: its prompt and the tokens already streamed.
A resume re-prefills ``prompt + generated`` (on the restarted node or another one), samples the next
token with the sampler advanced past the ``len(generated)`` draws already made (``draw_seed`` in
``mlxcel.engine.sampling``: a token's random key depends only on the seed and its position), and
goes on streaming: the client sees neither an error nor a duplicated or missing token, greedy output
equals an undisturbed run and a seeded one continues its random sequence.

``ResumePolicy`` (``mlxcel.engine.resume_policy``, re-exported here) bounds it: at most
``max_resumes`` resumes per request, each waiting at most ``wait_s`` for a node to take it again.
The same bound holds a new request whose start failed with such a node failure (``Hold``,
``mlxcel.engine.holding``; docs/pipeline.md §5.6). ``replayable`` gives a sampled request without a
seed one, so that a resume continues its random stream.

``Resumer`` is both, as one object over the scheduler's ``RequestTable`` and its executor: it moves
requests WAITING (held), RESUMING and back to PREFILLING, and ends those past their bounds through the
scheduler's ``finish``. It runs on the scheduler thread; the loop, admission and planning stay in the
scheduler. An executor that can resume (``mlxcel.pipeline.coordinator.PipelineExecutor``) sets
``resume_policy`` and answers ``resumable(exc)``: whether a failed step lost the sequence's state to a
node failure (resume it) rather than failed on the request itself (end it); ``ExecutorBase``'s
defaults (no policy, nothing resumable) turn both off.

The disaggregated router resumes and holds its own requests (``mlxcel.disagg.waiting``) with the same
pieces: ``ResumePolicy`` (bounds, deadline, cadence), ``Hold`` (each held request's clock and its 503)
and ``replayable``; not with a ``Resumer``, which polls a request table from the scheduler's loop and
prepares again on an executor, where the router's requests move on its transport's, monitor's and
timers' threads under its lock and are resumed by dispatching a new attempt to other nodes
(docs/engine.md, "Request states").
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Callable, Protocol

from mlxcel.engine.holding import Hold, start_may_wait
from mlxcel.engine.requests import RequestState, RequestTable, Seq
from mlxcel.engine.resume_policy import RETRY_S, ResumePolicy
from mlxcel.engine.sampling import SamplingParams, random_seed
from mlxcel.error_codes import ErrorCode, code_of

if TYPE_CHECKING:
    from mlxcel.engine.executor import ExecutorBase

__all__ = ["RETRY_S", "ResumePolicy", "Resumer", "replayable"]

log = logging.getLogger("mlxcel.engine")


def replayable(params: SamplingParams, policy: ResumePolicy | None) -> SamplingParams:
    """``params`` as a resume can replay them: a sampled request that names no seed gets one here while
    resuming is on, so that a resume continues its random stream (the scheduler's and the router's)."""
    if policy is not None and policy.enabled and not params.greedy and params.seed is None:
        return replace(params, seed=random_seed())
    return params


class Finish(Protocol):
    """The scheduler's way to end a request and tell its client."""

    def __call__(self, seq: Seq, reason: str, error: str | None = None, code: ErrorCode | None = None) -> None: ...


class Resumer:
    """Resumes the requests a node failure lost and holds the new ones while no node can start them."""

    def __init__(self, table: RequestTable, executor: ExecutorBase, policy: ResumePolicy | None, *,
                 context_length: int, finish: Finish, release: Callable[[str], None]):
        self.table = table
        self.executor = executor
        self.policy = policy if policy is not None and policy.enabled else None
        self.context_length = context_length
        self._finish = finish
        self._release = release  # frees a sequence on the executor (its errors logged, never raised)
        self.hold = Hold(self.policy.wait_s if self.policy is not None else 0.0)  # new requests held now

    # -- resuming after a node failure ---------------------------------------------------------

    def may_resume(self, seq: Seq, exc: BaseException) -> bool:
        """Whether ``seq``, whose step failed with ``exc``, is resumed instead of failed: the executor says
        the node failure lost its state, its bounds are not spent, it fits the context for a re-prefill."""
        if self.policy is None or not self.executor.resumable(exc):
            return False
        return self.policy.allows(seq.resumes, len(seq.request.prompt) + len(seq.generated), self.context_length)

    def suspend(self, seq: Seq, exc: BaseException) -> None:
        """Take ``seq`` off the executor (its step just returned, and the scheduler took it out of its decode
        group, so nothing names it) to resume it."""
        assert self.policy is not None
        self.table.move(seq, RequestState.RESUMING)
        seq.group, seq.todo = None, []
        self.policy.begin(seq, time.monotonic())
        seq.resume_error = exc
        log.warning("request %s lost to a node failure after %d tokens (%s); resuming it (%d of at most %d)",
                    seq.rid, len(seq.generated), exc, seq.resumes, self.policy.max_resumes)
        self._release(seq.rid)

    def waiting_only(self, now: float) -> bool:
        """No resuming request is due to be tried before ``now``."""
        return all(seq.resume_next > now for seq in self.table.resuming)

    def resume_due(self) -> None:
        """Prepare again every resuming sequence whose try is due; fail those past their deadline."""
        now = time.monotonic()
        due = [s for s in self.table.resuming if s.resume_next <= now]
        if not due:
            return
        try:
            self.executor.check_peers()  # once per pass: a node that restarted is seen as such first
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
            full = seq.full
            seq.todo = full[cached:]
            self.table.move(seq, RequestState.PREFILLING)
            self.table.counters.resumed += 1
            log.info("request %s resumed: re-prefilling %d tokens (%d cached)", seq.rid, len(full) - cached, cached)

    def _not_yet(self, seq: Seq, exc: BaseException) -> None:
        """A try to resume ``seq`` failed with ``exc``: try again shortly, or fail it past its deadline or
        when the failure is not one to wait for (a PREPARE refused ``not_found``: ``start_may_wait``)."""
        seq.resume_error = exc
        assert self.policy is not None
        if not (start_may_wait(exc, self.executor.resumable) and self.policy.again(seq, time.monotonic())):
            self._resume_failed(seq)

    def _prepare_again(self, seq: Seq) -> int:
        """The executor's ``prepare`` with prompt + generated, the sampler past the tokens sampled so far."""
        return self.executor.prepare(seq.rid, seq.params or seq.request.params, seq.request.top_logprobs, seq.full,
                                     draws=len(seq.generated), attempt=seq.resumes)

    def _resume_failed(self, seq: Seq) -> None:
        exc = seq.resume_error
        self.table.counters.resume_failed += 1
        assert self.policy is not None
        log.warning("request %s could not be resumed within %gs: %s", seq.rid, self.policy.wait_s, exc)
        self._finish(seq, "error", error=f"generation failed and could not be resumed: {exc}",
                     code=code_of(exc) if exc is not None else ErrorCode.UNAVAILABLE)

    # -- holding new requests while a node is down (the same policy's bound) ---------------------

    def may_hold(self, seq: Seq, exc: BaseException) -> bool:
        """Whether a new request whose start failed with ``exc`` waits for the node instead of failing:
        resuming is on and the failure is a node failure of the unavailable class (``holding.start_may_wait``)."""
        return self.policy is not None and seq.handoff is None and start_may_wait(exc, self.executor.resumable)

    def hold_all(self, exc: BaseException) -> None:
        """The head of the queue could not start: hold every waiting request from now, when the failed start
        came back (a PREPARE nobody answered waited its whole timeout first); try again in ``RETRY_S``."""
        assert self.policy is not None
        now = time.monotonic()
        if self.hold.failed(exc, now):
            log.warning("holding new requests until the pipeline can start them again (%s); each waits at most "
                        "%gs (--resume-timeout)", exc, self.policy.wait_s)
        for seq in self.table.waiting:
            self.held(seq, now)
        self.expire_held(now)

    def held(self, seq: Seq, now: float) -> None:
        """Hold ``seq`` from ``now`` (a request arriving while others are held: from its arrival)."""
        if self.hold.hold(seq, now):
            self.table.counters.holds += 1

    def started(self) -> None:
        """A start succeeded: if requests were held, the node is back and they start in their order."""
        if not self.hold.active:
            return
        log.info("the pipeline starts requests again: %d held request(s) go on", self.table.held())
        self.hold.end()
        for seq in self.table.waiting:
            seq.held_since = 0.0

    def expire_held(self, now: float) -> None:
        """Fail the held requests past their bound (503 + Retry-After); stop holding when none is left."""
        exc = self.hold.error
        for seq in [s for s in self.table.waiting if self.hold.expired(s, now)]:
            self.table.counters.hold_failed += 1
            log.warning("request %s held %.1fs and not started: %s", seq.rid, now - seq.held_since, exc)
            self._finish(seq, "error", error=self.hold.message(seq, now),
                         code=code_of(exc) if exc is not None else ErrorCode.UNAVAILABLE)
        if not self.table.waiting:
            self.hold.end()
