"""One authenticated connection: a sealer under a write lock, a reader thread, RPC waiters, streams.

The reader thread opens frames, reassembles messages and dispatches them: RPC
responses wake their waiter, RPC requests are answered by the request handler, every
other message goes to the message handler, all on this thread and in frame order.
"""

from __future__ import annotations

import logging
import socket
import threading
from typing import Callable, Iterable

from .errors import ClusterError, ConnectionLost, FrameError, LocalProtocolError, RequestError, RequestTimeout, SequenceExhausted
from .frames import Buffer, FrameOpener, FrameSealer
from .handshake import Established
from .identity import PeerId
from .messages import Assembler, Body, Message, body_len, encode_error, plan
from .options import TransportOptions
from .aead_pipeline import CryptoPool, OpenPipeline, SealPipeline, ring_slots
from .ratelimit import RateLimitedLog, WarnClass
from .reader import FrameReader
from .rpc import Waiter, answer, outcome
from .wire import STREAM_ABORTED, STREAM_OK, ErrorCode, Kind

log = logging.getLogger("mlxcel.cluster.transport")


class Connection:
    """One authenticated connection: a sealer and write lock, an opener and reader thread.

    ``deliver`` gets one-way and stream messages, ``handle_request`` answers RPC
    requests (its return value is the response body), ``forget`` is called once the
    connection closed.  With a ``crypto`` pool (and an AEAD suite) the chunks of a
    fragmented message are sealed and opened on its helpers beside the socket copy.
    """

    def __init__(
        self,
        sock: socket.socket,
        peer: PeerId,
        est: Established,
        inbound: bool,
        *,
        options: TransportOptions,
        warnings: RateLimitedLog,
        deliver: Callable[[Message], None],
        handle_request: Callable[[Message], Buffer],
        forget: Callable[["Connection"], None],
        crypto: CryptoPool | None = None,
    ) -> None:
        self.sock = sock
        self.peer = peer
        self.inbound = inbound
        self.options = options
        self.warnings = warnings
        self._deliver, self._handle_request, self._forget = deliver, handle_request, forget
        self.sealer = FrameSealer(est.suite, est.send_key, max_frame_len=options.max_frame_len, seq_limit=options.seq_limit)
        self.opener = FrameOpener(est.suite, est.recv_key, max_frame_len=options.max_frame_len, seq_limit=options.seq_limit)
        self.assembler = Assembler(peer, max_message_len=options.max_message_len)
        self._crypto = crypto if crypto is not None and self.sealer.aead else None
        self._seal_pipe: SealPipeline | None = None
        self._wlock = threading.Lock()
        self._closed = threading.Event()
        self._waiters: dict[int, Waiter] = {}
        self._waiters_lock = threading.Lock()
        self.thread: threading.Thread | None = None

    def __repr__(self) -> str:
        return f"Connection(peer={self.peer}, inbound={self.inbound}, alive={self.alive})"

    @property
    def alive(self) -> bool:
        return not self._closed.is_set()

    def start(self) -> None:
        """Run the reader on a new thread (outbound connections)."""
        name = f"mlxcel-cluster-{'in' if self.inbound else 'out'}-{self.peer}"
        self.thread = threading.Thread(target=self.read_loop, name=name, daemon=True)
        self.thread.start()

    # -- sending --

    def send(self, kind: Kind, payload: Body, *, id: int = 0, status: int = 0) -> None:
        """Seal and send one message (fragmented as needed) under the write lock; ``payload``
        may be a sequence of buffers, sent as their concatenation without joining them."""
        chunk_len = self.options.chunk_len
        if isinstance(payload, (bytes, bytearray, memoryview)):
            view: Body = payload if isinstance(payload, (bytes, bytearray)) else memoryview(payload).cast("B")
        else:
            view = payload if isinstance(payload, list) else list(payload)
        size = body_len(view)
        pipelined = self._crypto is not None and size > chunk_len and size >= self.options.effective_crypto_pipeline_min_len
        frames: Iterable[tuple[Kind, Buffer]]
        if pipelined:
            frames = list(plan(kind, view, id=id, status=status, chunk_len=chunk_len, ramp_len=self.options.chunk_ramp_len))
        else:
            frames = plan(kind, view, id=id, status=status, chunk_len=chunk_len)
        with self._wlock:
            if self._closed.is_set():
                raise ConnectionLost(f"connection to {self.peer} is closed")
            try:
                if pipelined and self._pipeline().send(frames, self._sendmsg):  # type: ignore[arg-type]
                    return
                for fkind, fpayload in frames:
                    self._sendmsg(self.sealer.seal_parts(fkind, fpayload))
            except SequenceExhausted as exc:
                log.info("closing cluster connection to %s: %s", self.peer, exc)
                self.close()
                raise
            except OSError as exc:
                self.close()
                raise ConnectionLost(f"sending to {self.peer} failed: {exc.strerror or type(exc).__name__}") from None

    def _pipeline(self) -> SealPipeline:
        if self._seal_pipe is None:
            assert self._crypto is not None
            self._seal_pipe = SealPipeline(self.sealer, self._crypto, max(self.options.chunk_len, 64),
                                           ring_slots(self._crypto.workers))
        return self._seal_pipe

    def _sendmsg(self, parts: tuple[tuple[Buffer, ...], int]) -> None:
        bufs, total = parts
        sent = self.sock.sendmsg(bufs)
        if sent == total:
            return
        views = [memoryview(p).cast("B") for p in bufs]
        while sent < total:
            total -= sent
            while sent and sent >= len(views[0]):
                sent -= len(views.pop(0))
            if sent:
                views[0] = views[0][sent:]
            sent = self.sock.sendmsg(views)

    # -- receiving --

    def read_loop(self) -> None:
        """Read, open and dispatch until EOF or an error; then close and forget.

        Drives the sans-I/O ``FrameReader``: it says where the next bytes go, the
        socket fills that view, the assembler turns opened frames into messages."""
        capacity = max(self.options.chunk_len, 65536) + 64
        pipe = (OpenPipeline(self.opener, self._crypto, max(self.options.chunk_len, 64), ring_slots(self._crypto.workers))
                if self._crypto is not None else None)
        rd = FrameReader(self.opener, destination=self.assembler.destination, capacity=capacity, pipeline=pipe,
                         pipeline_min_len=self.options.effective_crypto_pipeline_min_len)
        read_frame, recv_target, received, drain = rd.read_frame, rd.recv_target, rd.received, rd.drain
        recv_into, frame_done = self.sock.recv_into, self.assembler.frame_done
        try:
            while True:
                got = read_frame()
                if got is None:
                    view, exact = recv_target()
                    n = recv_into(view, len(view), socket.MSG_WAITALL if exact else 0)
                    if not n:
                        raise EOFError
                    received(n)
                    continue
                msg = frame_done(*got)
                if msg is not None:
                    drain()  # every chunk of the message authenticated
                    self._dispatch(msg)
        except EOFError:
            log.debug("cluster connection %s closed by the peer", self.peer)
        except SequenceExhausted as exc:  # the protocol's orderly end of a connection
            log.info("closing cluster connection with %s: %s", self.peer, exc)
        except (FrameError, LocalProtocolError) as exc:
            self.warnings.warning(WarnClass.DIAGNOSTIC, "closing cluster connection with %s: %s", self.peer, exc)
        except OSError as exc:
            if not self._closed.is_set():
                log.debug("cluster connection %s failed: %s", self.peer, exc.strerror or type(exc).__name__)
        except Exception:  # a bug must cost one connection, never the process
            log.exception("closing cluster connection with %s after an internal error", self.peer)
        finally:
            if pipe is not None:
                pipe.close()
            self._finalize()

    def _dispatch(self, msg: Message) -> None:
        kind = msg.kind
        if kind is Kind.RPC_RESPONSE:
            self._resolve(msg)
        elif kind is Kind.RPC_REQUEST:
            self._answer(msg)
        else:
            self._deliver(msg)

    def _answer(self, msg: Message) -> None:
        reply, status = answer(self._handle_request, msg)
        try:
            self.send(Kind.RPC_RESPONSE, reply, id=msg.id, status=status)
        except ClusterError as exc:
            log.debug("cannot answer request %d from %s: %s", msg.id, self.peer, exc)

    def _resolve(self, msg: Message) -> None:
        with self._waiters_lock:
            waiter = self._waiters.pop(msg.id, None)
        if waiter is None:
            log.debug("dropping a response to unknown or expired request %d from %s", msg.id, self.peer)
            return
        waiter.message = msg
        waiter.event.set()

    # -- rpc --

    def request(self, payload: Buffer, request_id: int, timeout: float) -> memoryview:
        """Send an RPC request and wait for its response on this connection; raises
        ``RequestFailed`` (with its ``code``) for an error response."""
        waiter = Waiter()
        with self._waiters_lock:
            self._waiters[request_id] = waiter
        try:
            self.send(Kind.RPC_REQUEST, payload, id=request_id)
            if not waiter.event.wait(timeout):
                raise RequestTimeout(f"no response from {self.peer} within {timeout:g}s")
        finally:
            with self._waiters_lock:
                self._waiters.pop(request_id, None)
        if waiter.error is not None:
            raise waiter.error
        assert waiter.message is not None
        return outcome(waiter.message, self.peer)

    # -- closing --

    def close(self) -> None:
        """Shut the socket down (wakes the reader and any blocked sender) and fail
        pending requests; idempotent.  The reader thread closes the descriptor."""
        if self._closed.is_set():
            return
        self._closed.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        with self._waiters_lock:
            waiters, self._waiters = self._waiters, {}
        for waiter in waiters.values():
            waiter.error = ConnectionLost(f"connection to {self.peer} closed before the response arrived")
            waiter.event.set()

    def _finalize(self) -> None:
        self.close()
        with self._wlock:  # a sender blocked before the shutdown has returned by now
            self.sock.close()
        self._forget(self)


class StreamWriter:
    """An outbound stream: ordered STREAM_DATA messages ended by one STREAM_END.

    ``close()`` ends it as completed (status 0); ``abort(code, text)`` or an exception
    inside ``with`` ends it as aborted (status 1, an error body)."""

    def __init__(self, conn: Connection, stream_id: int) -> None:
        self._conn = conn
        self.id = stream_id
        self.closed = False

    @property
    def connection(self) -> Connection:
        """The connection this stream travels on (its lane's, ``Transport.open_stream``)."""
        return self._conn

    def write(self, data: Body) -> None:
        """One STREAM_DATA message: a buffer, or a sequence of buffers sent as their concatenation."""
        if self.closed:
            raise LocalProtocolError(f"stream {self.id} is closed")
        self._conn.send(Kind.STREAM_DATA, data, id=self.id)

    def close(self, status: int = STREAM_OK, payload: Buffer = b"") -> None:
        """Send STREAM_END with ``status`` and ``payload`` (once)."""
        if not self.closed:
            self.closed = True
            self._conn.send(Kind.STREAM_END, payload, id=self.id, status=status)

    def abort(self, code: ErrorCode = ErrorCode.INTERNAL, text: str = "") -> None:
        """End the stream as aborted, with a typed error body."""
        self.close(STREAM_ABORTED, encode_error(code, text))

    def __enter__(self) -> "StreamWriter":
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: object) -> None:
        if exc is None:
            self.close()
        elif not self.closed and self._conn.alive:
            if isinstance(exc, RequestError):
                self.abort(exc.code, exc.message)
            else:  # the type only: the text may quote payload
                self.abort(ErrorCode.INTERNAL, type(exc).__name__)
