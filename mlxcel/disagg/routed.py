"""The router's records: a configured node (``NodeInfo``) and a client request with its current attempt
(``Routed``), kept apart from ``RouterEngine`` so that its parts (``mlxcel.disagg.waiting``) import them
without importing the router.

A routed request's state is one field, ``Routed.state`` (a ``RouteState``), changed only through
``Routed.move``: the engine's state machinery (``mlxcel.engine.requests``: ``Stateful``, ``transition_table``,
``IllegalTransition`` for a move the table does not allow, a router bug; nothing changes then) over this
table (docs/disagg.md §5, "Router request"):

    NEW --nodes up--> PREFILLING            NEW --no node of a role up, resuming on--> HELD
    HELD --a node of each role up--> PREFILLING
    PREFILLING --its prefill node's HANDED_OFF--> DECODING
    PREFILLING, DECODING --failed, failed over to other nodes (a new attempt)--> PREFILLING
    PREFILLING, DECODING --failed, resumed (docs/disagg.md §6.1)--> RESUMING --nodes up--> PREFILLING
    PREFILLING, DECODING --> FINISHED_STOPPED, FINISHED_LENGTH, FINISHED_ERROR, FINISHED_CANCELLED
    HELD, RESUMING --> FINISHED_ERROR (past --resume-timeout, shutdown), FINISHED_CANCELLED

A FINISH may end an attempt still PREFILLING: its prefill node's HANDED_OFF travels on another
connection and may come later (``mlxcel.disagg.late_handoffs``). A request refused at once (no node up
with resuming off, or the hold bound reached) never leaves NEW and is dropped.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping

from mlxcel.cluster.exchanges import Exchange
from mlxcel.cluster.identity import PeerId
from mlxcel.disagg.prefix_routing import PromptKey
from mlxcel.engine.interface import EngineRequest, FinishEvent
from mlxcel.engine.requests import Lifecycle, Stateful, transition_table
from mlxcel.engine.sampling import SamplingParams
from mlxcel.engine.textstream import SequenceText
from mlxcel.error_codes import ErrorCode


@dataclass(eq=False)
class NodeInfo:
    """One configured node: its router-assigned id, role and counters."""

    id: str
    role: str
    address: PeerId
    dispatched: int = 0
    failures: int = 0
    completed: int = 0
    down_reason: str = ""


class RouteState(Lifecycle):
    """Where a client request is in the router (the module docstring has the transitions)."""

    NEW = "new"  # submitted: dispatched, held or refused at once
    HELD = "held"  # no node of a role up: waiting for one in the router's held queue (docs/disagg.md §6.2)
    PREFILLING = "prefilling"  # an attempt is out: GENERATE sent, its prefill node's HANDED_OFF not in yet
    DECODING = "decoding"  # its prefill node handed the KV off: the attempt depends on its decode node only
    RESUMING = "resuming"  # its attempt failed; waiting for a node of each role to resume it (§6.1)
    FINISHED_STOPPED = "finished_stopped"  # EOS or a stop string
    FINISHED_LENGTH = "finished_length"  # max_tokens
    FINISHED_ERROR = "finished_error"
    FINISHED_CANCELLED = "finished_cancelled"  # the client went away


R = RouteState
_ENDS_EARLY = frozenset({R.FINISHED_ERROR, R.FINISHED_CANCELLED})
_ENDS = _ENDS_EARLY | {R.FINISHED_STOPPED, R.FINISHED_LENGTH}
ROUTE_TRANSITIONS: dict[RouteState, frozenset[RouteState]] = transition_table({
    R.NEW: frozenset({R.PREFILLING, R.HELD}),
    R.HELD: frozenset({R.PREFILLING}) | _ENDS_EARLY,
    R.PREFILLING: frozenset({R.PREFILLING, R.DECODING, R.RESUMING}) | _ENDS,
    R.DECODING: frozenset({R.PREFILLING, R.RESUMING}) | _ENDS,
    R.RESUMING: frozenset({R.PREFILLING}) | _ENDS_EARLY,
})
ATTEMPT_OUT = frozenset({R.PREFILLING, R.DECODING})  # an attempt's exchange is open on nodes
_BY_REASON = {"stop": R.FINISHED_STOPPED, "length": R.FINISHED_LENGTH, "error": R.FINISHED_ERROR}


def finished_state(event: FinishEvent) -> RouteState:
    """The state a request ends in with ``event`` (one carrying an error always ends in FINISHED_ERROR)."""
    return R.FINISHED_ERROR if event.error is not None else _BY_REASON[event.finish_reason]


@dataclass(eq=False)
class Routed(Stateful):
    """One client request and its current attempt."""

    transitions: ClassVar[Mapping[RouteState, frozenset[RouteState]]] = ROUTE_TRANSITIONS

    request: EngineRequest
    stream: Any  # EventStream
    state: RouteState = RouteState.NEW
    attempts: int = 0
    emitted: int = 0
    prefill: PeerId | None = None
    decode: PeerId | None = None
    exchange: Exchange | None = None
    early_first: int | None = None  # this attempt's first token, relayed from its prefill node (None: not yet)
    decode_spoke: bool = False  # this attempt's decode node sent TOKENS
    arrived: float = field(default_factory=time.monotonic)  # when it was submitted
    held_since: float = 0.0  # while HELD: since when (``mlxcel.engine.holding.Hold``)
    params: SamplingParams | None = None  # the request's, its seed resolved so that a resume replays it
    tokens: list[int] = field(default_factory=list)  # every token relayed to the client, in order
    text: SequenceText | None = None  # after a resume: the text is assembled here (the nodes' starts midway)
    resumes: int = 0
    resume_deadline: float = 0.0  # while RESUMING: give up at this time (monotonic; ``ResumePolicy.begin``)
    resume_next: float = 0.0  # while RESUMING: the next try
    resume_error: tuple[ErrorCode, str] = (ErrorCode.UNAVAILABLE, "")  # the failure being resumed
    key: PromptKey | None = None  # the current attempt's prompt block hashes (--route-policy prefix; else None)

    @property
    def rid(self) -> str:
        return self.request.request_id

    @property
    def handed_off(self) -> bool:
        """Whether the current attempt's prefill node handed the KV off (it no longer depends on that node)."""
        return self.state is RouteState.DECODING
