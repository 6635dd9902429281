"""RPC semantics over one connection: response waiters and typed errors (docs/protocol.md §5).

A handler's exception becomes an error response by its type, never by its text: a
cluster error answers its class's code (``RequestError`` its own, a forwarded
``RequestFailed`` the downstream code), any other ``TimeoutError`` TIMEOUT, anything
else INTERNAL.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from .errors import ClusterError, RequestError, RequestFailed
from .frames import Buffer
from .identity import PeerId
from .messages import Message, decode_error, encode_error
from .wire import RPC_ERROR, RPC_OK, ErrorCode

log = logging.getLogger("mlxcel.cluster.transport")


class Waiter:
    """One outstanding request: woken by its response or by the connection closing."""

    __slots__ = ("event", "message", "error")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.message: Message | None = None
        self.error: BaseException | None = None


def error_for(exc: BaseException) -> tuple[ErrorCode, str]:
    """The typed code and one-line text a failing handler answers with."""
    if isinstance(exc, ClusterError):
        code = exc.code
    else:
        code = ErrorCode.TIMEOUT if isinstance(exc, TimeoutError) else ErrorCode.INTERNAL
    if isinstance(exc, RequestError):
        return code, exc.message
    if isinstance(exc, RequestFailed):
        return code, exc.detail or str(exc)
    return code, f"{type(exc).__name__}: {exc}"


def answer(handler: Callable[[Message], Buffer], msg: Message) -> tuple[Buffer, int]:
    """(response body, status) for a request: the handler's reply, or an error body."""
    try:
        reply = handler(msg)
    except Exception as exc:  # a failing handler answers with an error, never kills the loop
        log.debug("request handler failed for %s", msg, exc_info=not isinstance(exc, RequestError))
        return encode_error(*error_for(exc)), RPC_ERROR
    return (reply if reply is not None else b""), RPC_OK


def outcome(msg: Message, peer: PeerId) -> memoryview:
    """The body of an ok response; raises ``RequestFailed`` (with the code) for any other status."""
    if msg.status == RPC_OK:
        return msg.payload
    code, text = decode_error(msg.payload)
    raise RequestFailed(f"{peer} failed the request ({code.name}): {text}", code, text)
