"""The request table: every request the scheduler holds, its one state field and the rules that move it.

A request's state is ``Seq.state`` (a ``RequestState``), changed only through ``RequestTable.move``
(``Seq.move`` checks it against ``TRANSITIONS`` and raises ``IllegalTransition``, a scheduler bug, for a
move the table does not allow); the table also keeps the queue of each queued state in arrival order:

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

A finished state is final: a finished request leaves the table. This module runs no thread, takes no
lock and imports neither the executor nor the scheduler (``tests/engine/test_layout.py``): the
scheduler thread (``mlxcel.engine.scheduler``) and the resume object (``mlxcel.engine.resume``) are its
only users, both on that thread. docs/engine.md, "Request states".

The machinery is generic, and the router's record (``mlxcel.disagg.routed.Routed``) uses it too: a state
enum derives from ``Lifecycle`` (its ``FINISHED_*`` states are final), ``transition_table`` checks a table
as data (every state has a row, a finished one none), and a record derives from ``Stateful`` (``move``).
"""

from __future__ import annotations

import enum
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterator, Mapping, TypeVar

from mlxcel.engine.interface import EngineRequest
from mlxcel.engine.runner import Sampled
from mlxcel.engine.sampling import SamplingParams
from mlxcel.engine.textstream import SequenceText


class Lifecycle(enum.Enum):
    """The states of a request record (each record's enum derives from it): ``FINISHED_*`` ones are final."""

    @property
    def finished(self) -> bool:
        return self.name.startswith("FINISHED_")


State = TypeVar("State", bound=Lifecycle)


def transition_table(moves: Mapping[State, frozenset[State]]) -> dict[State, frozenset[State]]:
    """A transition table as data, checked: every state of the enum has a row, a finished state none (it is
    final; its empty row is filled in here). ``ValueError`` names what is wrong."""
    states = list(type(next(iter(moves))))
    missing = [s.name for s in states if s not in moves and not s.finished]
    moving = [s.name for s, row in moves.items() if s.finished and row]
    if missing or moving:
        raise ValueError(f"transition table: no row for {missing}; finished states that move: {moving}")
    return {s: frozenset(moves.get(s, ())) for s in states}


class IllegalTransition(RuntimeError):
    """A request was moved to a state its table does not allow from its own: a bug of the scheduler or the
    router, never a client's."""


class Stateful:
    """A record whose one ``state`` field changes only through ``move``, checked against ``transitions``."""

    transitions: ClassVar[Mapping[Any, frozenset[Any]]]
    state: Any

    @property
    def rid(self) -> str:
        raise NotImplementedError

    def move(self, to: Any) -> Any:
        """Enter state ``to``; returns the state left. ``IllegalTransition`` (and nothing changes) if the
        table forbids it."""
        if to not in self.transitions[self.state]:
            raise IllegalTransition(f"request {self.rid}: {self.state.name} -> {to.name} is not a transition")
        was, self.state = self.state, to
        return was


class RequestState(Lifecycle):
    """Where a request is in the scheduler (the module docstring has the transitions)."""

    WAITING = "waiting"  # queued for a slot (``waiting``)
    PREFILLING = "prefilling"  # admitted, prompt chunks to run (``prefilling``)
    JOINING = "joining"  # first token sampled (or, a prompt tail, its last token to run), waiting for a group
    RUNNING = "running"  # a member of decode group ``group``
    RESUMING = "resuming"  # lost to a node failure, waiting to be prepared again (``resuming``)
    FINISHED_STOPPED = "finished_stopped"  # EOS or a stop string
    FINISHED_LENGTH = "finished_length"  # max_tokens
    FINISHED_ERROR = "finished_error"
    FINISHED_CANCELLED = "finished_cancelled"  # the client went away


S = RequestState  # short for the tables and transitions below
_ENDS_EARLY = frozenset({S.FINISHED_ERROR, S.FINISHED_CANCELLED})
_ENDS = _ENDS_EARLY | {S.FINISHED_STOPPED, S.FINISHED_LENGTH}
TRANSITIONS: dict[RequestState, frozenset[RequestState]] = transition_table({
    S.WAITING: frozenset({S.PREFILLING, S.JOINING}) | _ENDS_EARLY,
    S.PREFILLING: frozenset({S.JOINING, S.RESUMING}) | _ENDS_EARLY,
    S.JOINING: frozenset({S.RUNNING}) | _ENDS,
    S.RUNNING: _ENDS | {S.RESUMING},
    S.RESUMING: frozenset({S.PREFILLING}) | _ENDS_EARLY,
})
FINISHED_BY_REASON = {"stop": S.FINISHED_STOPPED, "length": S.FINISHED_LENGTH, "error": S.FINISHED_ERROR}


@dataclass(frozen=True)
class Handoff:
    """What a prefill node produced: the KV cache of the whole prompt and the token sampled after it."""

    first: Sampled
    cache: Any


@dataclass(eq=False)
class Seq(Stateful):
    """One request in the scheduler: what it asked for, where it is, and what it needs to go on."""

    transitions: ClassVar[Mapping[RequestState, frozenset[RequestState]]] = TRANSITIONS

    request: EngineRequest
    stream: Any  # EventStream (or a sink during warmup)
    text: SequenceText
    offthread: bool = False  # its text is assembled on the emitter thread (no stop strings to decide on)
    todo: list[int] = field(default_factory=list)  # prompt tokens not yet prefilled (JOINING: the batched tail)
    generated: list[int] = field(default_factory=list)
    group: int | None = None  # decode micro-batch, once RUNNING
    busy: bool = False  # a prefill step of it is in flight
    decoding: int = 0  # decode steps naming it in flight (2 while the next is queued behind the current)
    handoff: Handoff | None = None  # prefilled elsewhere: adopted on admission instead of prefilled
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

    @property
    def full(self) -> list[int]:
        """Its prompt and every token generated so far: what a resume prefills again."""
        return list(self.request.prompt) + self.generated


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

    def count_decode(self, rows: int) -> None:
        """A decode step of ``rows`` sequences was planned."""
        self.decode_steps += 1
        self.decode_rows += rows
        self.shared_steps += rows >= 2
        self.max_rows = max(self.max_rows, rows)
        self.decoding = rows


class RequestTable:
    """Every unfinished request by id, the queue of each queued state in order, and the counters."""

    def __init__(self) -> None:
        self.seqs: dict[str, Seq] = {}
        self.waiting: deque[Seq] = deque()
        self.prefilling: deque[Seq] = deque()
        self.joining: deque[Seq] = deque()  # first token sent, waiting for a group
        self.resuming: deque[Seq] = deque()  # lost to a node failure, to be prepared again
        self._queues: dict[RequestState, deque[Seq]] = {
            S.WAITING: self.waiting, S.PREFILLING: self.prefilling, S.JOINING: self.joining,
            S.RESUMING: self.resuming}
        self.counters = EngineCounters()

    def __len__(self) -> int:
        return len(self.seqs)

    def __iter__(self) -> Iterator[Seq]:
        return iter(list(self.seqs.values()))

    def get(self, rid: str) -> Seq | None:
        return self.seqs.get(rid)

    def add(self, seq: Seq) -> None:
        """Queue a new request (WAITING) at the end."""
        if seq.state is not S.WAITING or seq.rid in self.seqs:
            raise IllegalTransition(f"request {seq.rid}: added twice or not WAITING ({seq.state.name})")
        self.seqs[seq.rid] = seq
        self.waiting.append(seq)

    def move(self, seq: Seq, to: RequestState) -> RequestState:
        """The one way a request changes state: checked by ``Seq.move``, then from the queue of the state it
        left (if any) to the end of the queue of ``to`` (if any); a finished one leaves the table. Returns
        the state left."""
        was = seq.move(to)
        if was in self._queues:
            self._queues[was].remove(seq)
        if to in self._queues:
            self._queues[to].append(seq)
        if to.finished:
            self.seqs.pop(seq.rid, None)
        return was

    def admitted(self) -> int:
        """Requests holding a slot: every one but the waiting."""
        return len(self.seqs) - len(self.waiting)

    def held(self) -> int:
        return sum(1 for s in self.waiting if s.held_since)

    def gauges(self, steps_inflight: int) -> None:
        c = self.counters
        c.waiting, c.held, c.running, c.inflight_steps = len(self.waiting), self.held(), self.admitted(), steps_inflight
