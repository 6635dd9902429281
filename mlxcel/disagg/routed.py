"""The router's record of one client request and its current attempt (``RouterEngine``, ``NodeWaits``).

Its own module so that the router (``mlxcel.disagg.router``) and its waiting and resuming half
(``mlxcel.disagg.waiting``) both import it without importing each other.
"""

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
