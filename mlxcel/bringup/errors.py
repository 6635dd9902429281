"""Bring-up errors: one base; what a peer refuses, what ends a bring-up, what breaks the protocol."""

from __future__ import annotations

from dataclasses import dataclass

from mlxcel.error_codes import CodedError, ErrorCode

MSG_PROTOCOL_MISMATCH = "assignment protocol mismatch"
MSG_REFUSED = "stage assignment refused"


class BringupError(CodedError):
    """Base of every error raised by ``mlxcel.bringup``; ``code`` is its class in the one vocabulary."""


class AssignmentProtocolError(BringupError):
    """A malformed assignment message, or one the state machine does not expect now: the
    connection closes (a peer goes back to waiting)."""

    code = ErrorCode.BAD_REQUEST


class ProtocolMismatch(AssignmentProtocolError):
    """The other side speaks another assignment protocol version (version 1, say)."""

    code = ErrorCode.MISMATCH

    def __init__(self, theirs: object, ours: int) -> None:
        super().__init__(f"{MSG_PROTOCOL_MISMATCH}: the other side speaks version {theirs!r}, this node speaks {ours}")
        self.theirs = theirs


class AssignmentTimeout(BringupError, TimeoutError):
    """No frame arrived within its bound."""

    code = ErrorCode.TIMEOUT


class ChannelClosed(BringupError):
    """The other side closed the assignment connection."""

    code = ErrorCode.UNREACHABLE


@dataclass(frozen=True)
class Refusal:
    """Why a peer did not accept an offer; ``fatal``: a retry against the same coordinator cannot
    succeed, so the peer ends with "stage assignment refused" (else it goes back to waiting)."""

    reason: str
    fatal: bool


class AssignmentRefused(BringupError):
    """A peer refused an offer fatally: the peer process ends with this line."""

    code = ErrorCode.MISMATCH

    def __init__(self, reason: str) -> None:
        super().__init__(f"{MSG_REFUSED}: {reason}")
        self.reason = reason


class BringupFailed(BringupError):
    """The coordinator's bring-up failed and no stage was started; the text names every peer
    that did not commit and why."""

    code = ErrorCode.UNREACHABLE


class DiscoveryError(BringupError):
    """Discovery did not resolve the peers (too few or too many, or a forbidden address)."""

    code = ErrorCode.UNREACHABLE
