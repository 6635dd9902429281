"""Attribution-only unsealed frames: what the decode benchmark compares AES-256-GCM against.

A cluster seals every frame with AES-256-GCM, with no opt-out (docs/protocol.md §2). To attribute the
decode cost of that protection, bench code (``bench/protection_bench.py``) builds in-process pipeline
members whose frames go unsealed (``Suite.UNPROTECTED``; the handshake still authenticates both ends
with the cluster secret). The only way in is a token from ``attribution_only()``, called by bench code
in its own process and passed as the private ``_attribution`` argument of ``StageService`` and
``PipelineExecutor``. No flag, environment variable or TOML key leads here, and the two never meet:

- every role's start path (``mlxcel.entrypoints.Role.run``) calls ``enter_role``, which refuses to start a
  role in a process that was handed a token, and marks the process as serving;
- a serving process refuses ``attribution_only()``, a token passed to a pipeline member, and any
  ``Transport`` whose suite is not AES-256-GCM.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .errors import LocalError
from .options import TransportOptions
from .wire import DEFAULT_SUITE, Suite

__all__ = ["AttributionOnly", "AttributionRefused", "attribution_only", "check_suite", "enter_role",
           "serving_role", "transport_options"]


class AttributionRefused(LocalError):
    """Unsealed frames were asked for where a cluster serves, or with a token no bench code was handed."""


@dataclass(frozen=True, eq=False)
class AttributionOnly:
    """A bench's in-process permission for unsealed frames (from ``attribution_only``, never built by hand)."""

    purpose: str


class _State:
    """This process: the role it serves (None: none) and the tokens it handed out."""

    def __init__(self) -> None:
        self.serving: str | None = None
        self.issued: list[AttributionOnly] = []


_state = _State()


def serving_role() -> str | None:
    """The role this process serves, None in a bench or test process."""
    return _state.serving


def attribution_only(purpose: str) -> AttributionOnly:
    """Bench code only: a token for pipeline members whose frames go unsealed; refused in a serving process."""
    if _state.serving is not None:
        raise AttributionRefused(f"unsealed frames ({purpose}) refused: this process serves role {_state.serving}")
    token = AttributionOnly(purpose)
    _state.issued.append(token)
    return token


def enter_role(role: str) -> None:
    """Every role's start path: refuse in a process holding a token, else mark the process as serving."""
    if _state.issued:
        raise AttributionRefused(f"role {role} refuses to start: this process built attribution-only "
                                 "(unsealed) cluster transports; a serving process runs AES-256-GCM on every frame")
    _state.serving = role


def transport_options(token: AttributionOnly | None, *, who: str,
                      base: TransportOptions | None = None) -> TransportOptions:
    """The transport options of pipeline member ``who``: ``base`` (the cluster TOML's, else the defaults)
    as they are, or with unsealed frames given a token this process handed out (refused once it serves a
    role)."""
    base = base or TransportOptions()
    if token is None:
        return base
    if not isinstance(token, AttributionOnly):
        raise TypeError(f"{who}: _attribution takes an AttributionOnly token, not {type(token).__name__}")
    if not any(token is t for t in _state.issued):
        raise AttributionRefused(f"{who}: this token was not handed out by attribution_only()")
    if _state.serving is not None:
        raise AttributionRefused(f"{who}: unsealed frames refused: this process serves role {_state.serving}")
    return replace(base, suite=Suite.UNPROTECTED)


def check_suite(suite: Suite, who: str) -> None:
    """``Transport``'s check: in a serving process, every transport runs AES-256-GCM."""
    if _state.serving is not None and suite is not DEFAULT_SUITE:
        raise AttributionRefused(f"{who}: suite {suite.name} refused: this process serves role {_state.serving}, "
                                 "whose frames run AES-256-GCM")
