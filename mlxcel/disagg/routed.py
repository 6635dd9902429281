"""The router's records: a configured node (``NodeInfo``) and a client request with its current attempt
(``Routed``), kept apart from ``RouterEngine`` so that its parts (``mlxcel.disagg.waiting``) import them
without importing the router."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from mlxcel.cluster.exchanges import Exchange
from mlxcel.cluster.identity import PeerId
from mlxcel.engine.interface import EngineRequest
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


@dataclass(eq=False)
class Routed:
    """One client request and its current attempt."""

    request: EngineRequest
    stream: Any  # EventStream
    attempts: int = 0
    emitted: int = 0
    prefill: PeerId | None = None
    decode: PeerId | None = None
    exchange: Exchange | None = None
    handed_off: bool = False
    early_first: int | None = None  # this attempt's first token, relayed from its prefill node (None: not yet)
    decode_spoke: bool = False  # this attempt's decode node sent TOKENS
    done: bool = False
    started: float = field(default_factory=time.perf_counter)
    params: SamplingParams | None = None  # the request's, its seed resolved so that a resume replays it
    tokens: list[int] = field(default_factory=list)  # every token relayed to the client, in order
    text: SequenceText | None = None  # after a resume: the text is assembled here (the nodes' starts midway)
    resumes: int = 0
    resume_deadline: float = 0.0  # while a resume waits for nodes (monotonic)
    resume_error: tuple[ErrorCode, str] = (ErrorCode.UNAVAILABLE, "")  # the failure being resumed
