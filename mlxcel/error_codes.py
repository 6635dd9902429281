"""One error vocabulary from the wire to HTTP: ``ErrorCode`` and the ``CodedError`` base.

Every failure that crosses a process boundary or a layer of mlxcel carries one of these codes:
the cluster RPC's error body (u16, ``docs/protocol.md``), the stage protocol's ERROR message
(``docs/pipeline.md`` §4.4), the executors (``mlxcel.engine.executor.ExecutorError``), the
scheduler's ``FinishEvent`` and the HTTP layer, which maps a code to its status *by its class*:

* **unavailable** (the backend is down, busy or slow; retrying later can succeed):
  503 with ``Retry-After``;
* **bad input** (the request itself is wrong): 400;
* **cancelled**: 499 (nginx's "client closed request"; nobody reads it);
* everything else is **internal**: 500.

A peer's complaint about what *this* node sent it (a stage answering ``BAD_TENSOR`` to the
coordinator's step) is not the HTTP client's bad input: ``as_local`` turns such a code into
``INTERNAL`` at the boundary where it enters this node, keeping the peer's code for the logs.

The numeric values are wire values: stable, never reused. No MLX and no I/O here, so the cluster
layer can import it.
"""

from __future__ import annotations

import enum

RETRY_AFTER_S = 1  # what a 503 for an unavailable backend tells clients to wait


class ErrorClass(str, enum.Enum):
    """How an error is treated at the edge (HTTP status, retry advice)."""

    UNAVAILABLE = "unavailable"
    BAD_INPUT = "bad_input"
    CANCELLED = "cancelled"
    INTERNAL = "internal"


class ErrorCode(enum.IntEnum):
    """A typed error code; the value is what travels on the wire (u16 or a JSON integer)."""

    UNKNOWN = 0  # no code given, or a code this node does not know
    INTERNAL = 1  # the handler failed unexpectedly (a bug or a fault on the answering node)
    BAD_REQUEST = 2  # malformed or out-of-bounds request fields
    UNAUTHORIZED = 3  # the authenticated sender may not make this request
    NOT_FOUND = 4  # unknown request id, sequence or resource
    CONFLICT = 5  # state conflict: id already in use, stale epoch or exchange nonce
    OVERLOADED = 6  # at capacity; retry later
    TIMEOUT = 7  # a deadline passed while handling the request
    UNAVAILABLE = 8  # draining, shutting down or not ready yet
    UNSUPPORTED = 9  # this node serves no such request
    CANCELLED = 10  # the request was cancelled
    BAD_TENSOR = 11  # a tensor's dtype, rank, shape or byte count is outside the bounds
    UNREACHABLE = 12  # a peer that the work needs cannot be reached (a stage down, no downstream)
    MISMATCH = 13  # a peer serves another model, cluster, node or layer range

    @property
    def wire_name(self) -> str:
        """The lower-case name used in docs and operator messages (``bad_tensor``)."""
        return self.name.lower()

    @property
    def error_class(self) -> ErrorClass:
        return _CLASS.get(self, ErrorClass.INTERNAL)

    @property
    def http_status(self) -> int:
        return _HTTP[self.error_class]

    @property
    def retryable(self) -> bool:
        """Whether a client should retry later (the 503 + Retry-After class)."""
        return self.error_class is ErrorClass.UNAVAILABLE

    @classmethod
    def from_wire(cls, value: object) -> "ErrorCode":
        """The code of a wire value; ``UNKNOWN`` for anything else (booleans included)."""
        if isinstance(value, bool) or not isinstance(value, int):
            return cls.UNKNOWN
        try:
            return cls(value)
        except ValueError:
            return cls.UNKNOWN

    def as_local(self) -> "ErrorCode":
        """This code, received from a peer, as a failure of this node: a peer's complaint about
        our own message (bad input, unauthorized, unknown, conflict, mismatch) is our internal
        error; unavailability and cancellation keep their meaning."""
        if self.error_class in (ErrorClass.UNAVAILABLE, ErrorClass.CANCELLED):
            return self
        return ErrorCode.INTERNAL


_CLASS = {
    ErrorCode.OVERLOADED: ErrorClass.UNAVAILABLE,
    ErrorCode.TIMEOUT: ErrorClass.UNAVAILABLE,
    ErrorCode.UNAVAILABLE: ErrorClass.UNAVAILABLE,
    ErrorCode.UNREACHABLE: ErrorClass.UNAVAILABLE,
    ErrorCode.BAD_REQUEST: ErrorClass.BAD_INPUT,
    ErrorCode.BAD_TENSOR: ErrorClass.BAD_INPUT,
    ErrorCode.UNSUPPORTED: ErrorClass.BAD_INPUT,
    ErrorCode.CANCELLED: ErrorClass.CANCELLED,
}
_HTTP = {ErrorClass.UNAVAILABLE: 503, ErrorClass.BAD_INPUT: 400, ErrorClass.CANCELLED: 499,
         ErrorClass.INTERNAL: 500}


class CodedError(Exception):
    """An error with a typed ``code``: its class's, or the one given (a class that carries several);
    ``peer_code`` is set when a peer reported it first."""

    code: ErrorCode = ErrorCode.INTERNAL
    peer_code: ErrorCode | None = None

    def __init__(self, message: str = "", code: ErrorCode | None = None, *, peer_code: ErrorCode | None = None):
        super().__init__(message)
        if code is not None:
            self.code = ErrorCode(code)
        if peer_code is not None:
            self.peer_code = peer_code


def code_of(exc: BaseException) -> ErrorCode:
    """The code an exception carries (``INTERNAL`` for an uncoded one)."""
    code = getattr(exc, "code", None)
    return code if isinstance(code, ErrorCode) else ErrorCode.INTERNAL
