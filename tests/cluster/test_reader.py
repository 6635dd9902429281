"""The sans-I/O FrameReader that every connection runs: any split, any suite, any size.

``test_frames.py`` feeds it bytes; here it is driven exactly as the socket
connection drives it (``read_frame`` / ``recv_target`` / ``received`` with short
receives), with the message assembler as the destination and a small buffer so the
in-buffer, straight-to-destination and one-off-buffer paths all run.
"""

from __future__ import annotations

import os
import socket
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlxcel.cluster import connection as connection_module
from mlxcel.cluster.errors import FrameAuthError, FrameTooLarge, MessageError
from mlxcel.cluster.frames import FrameOpener, FrameSealer
from mlxcel.cluster.identity import PeerId
from mlxcel.cluster.messages import Assembler, plan
from mlxcel.cluster.reader import BIG, FrameReader
from mlxcel.cluster.wire import FRAME_HEADER, Kind, Suite

from .conftest import CLIENT_IP, SERVER_IP, Inbox

KEY = bytes(range(32))
PEER = PeerId("127.0.0.1", 1)
CAPACITY = 1024 + 64
pytestmark = pytest.mark.timeout(60)
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MESSAGES = st.lists(
    st.tuples(st.sampled_from([Kind.TENSOR_DATA, Kind.CONTROL, Kind.RPC_REQUEST, Kind.STREAM_END]), st.integers(0, 5000)),
    min_size=1,
    max_size=5,
)


def _wire(suite: Suite, messages: list[tuple[Kind, int]], chunk_len: int) -> tuple[bytes, list[tuple[Kind, bytes]]]:
    sealer = FrameSealer(suite, KEY)
    out, sent = [], []
    for i, (kind, size) in enumerate(messages):
        body = os.urandom(size)
        sent.append((kind, body))
        out += [sealer.seal(k, p) for k, p in plan(kind, body, id=i + 1, status=1 if kind == Kind.STREAM_END else 0, chunk_len=chunk_len)]
    return b"".join(out), sent


def _drive(reader: FrameReader, assembler: Assembler, wire: bytes, sizes: list[int]) -> list:
    """The connection's loop, with a fake receive that returns at most the next size."""
    got, off, i = [], 0, 0
    while off < len(wire) or reader.bytes_needed() == 0:
        frame = reader.read_frame()
        if frame is None:
            view, exact = reader.recv_target()
            assert len(view) >= 1 and (not exact or len(view) == reader.bytes_needed() or reader._plain)
            k = min(len(view), len(wire) - off, sizes[i % len(sizes)] if not exact else len(view))
            view[:k] = wire[off : off + k]
            off += k
            i += 1
            reader.received(k)
            continue
        msg = assembler.frame_done(*frame)
        if msg is not None:
            got.append(msg)
    return got


@FAST
@given(suite=st.sampled_from(list(Suite)), messages=MESSAGES, sizes=st.lists(st.integers(1, 3000), min_size=1, max_size=6))
def test_driven_like_a_socket(suite, messages, sizes):
    chunk_len = 2048  # frames up to 2 KiB + prefix: some fit the 1 KiB buffer, some do not
    wire, sent = _wire(suite, messages, chunk_len)
    assembler = Assembler(PEER)
    reader = FrameReader(FrameOpener(suite, KEY), destination=assembler.destination, capacity=CAPACITY)
    got = _drive(reader, assembler, wire, sizes)
    assert [(m.kind, bytes(m.payload)) for m in got] == sent
    assert [m.id for m in got if m.kind != Kind.TENSOR_DATA and m.kind != Kind.CONTROL] == [
        i + 1 for i, (k, _) in enumerate(messages) if k not in (Kind.TENSOR_DATA, Kind.CONTROL)
    ]
    assert reader.buffered == 0 and not assembler.in_progress


@FAST
@given(suite=st.sampled_from(list(Suite)), messages=MESSAGES)
def test_byte_at_a_time_through_the_assembler(suite, messages):
    wire, sent = _wire(suite, messages, 2048)
    assembler = Assembler(PEER)
    reader = FrameReader(FrameOpener(suite, KEY), destination=assembler.destination, capacity=CAPACITY)
    got = []
    for i in range(len(wire)):
        reader.receive_data(wire[i : i + 1])
        while (frame := reader.read_frame()) is not None:
            if (msg := assembler.frame_done(*frame)) is not None:
                got.append((msg.kind, bytes(msg.payload)))
    assert got == sent and reader.buffered == 0


@pytest.mark.parametrize("suite", [Suite.AES_256_GCM, Suite.HMAC_SHA256])
def test_large_stretches_are_received_exactly(suite):
    """A missing stretch of at least BIG bytes is one exact (MSG_WAITALL) receive."""
    sealer = FrameSealer(suite, KEY)
    frame = sealer.seal(Kind.TENSOR_DATA, os.urandom(3 * BIG))
    reader = FrameReader(FrameOpener(suite, KEY), capacity=4 * BIG)
    reader.receive_data(frame[:5])
    assert reader.read_frame() is None
    view, exact = reader.recv_target()
    assert exact and len(view) == reader.bytes_needed() - (suite == Suite.HMAC_SHA256) * 32
    view[:] = frame[5 : 5 + len(view)]
    reader.received(len(view))
    reader.receive_data(frame[5 + len(view) :])
    assert reader.next_frame() is not None


def test_small_needs_take_whatever_the_socket_has():
    """Below BIG the target is the whole free buffer: one receive can bring a header,
    a small frame and the next header."""
    reader = FrameReader(FrameOpener(Suite.AES_256_GCM, KEY), capacity=CAPACITY)
    view, exact = reader.recv_target()
    assert not exact and len(view) == CAPACITY
    assert reader.bytes_needed() == 5


def test_oversize_header_is_refused_before_any_target_is_offered():
    reader = FrameReader(FrameOpener(Suite.AES_256_GCM, KEY, max_frame_len=100), capacity=CAPACITY)
    view, _ = reader.recv_target()
    header = FRAME_HEADER.pack(Kind.TENSOR_DATA, 101)
    view[:5] = header
    reader.received(5)
    with pytest.raises(FrameTooLarge):
        reader.read_frame()


def test_bad_fragment_is_refused_from_the_header():
    assembler = Assembler(PEER)
    reader = FrameReader(FrameOpener(Suite.AES_256_GCM, KEY), destination=assembler.destination)
    reader.receive_data(FRAME_HEADER.pack(Kind.MESSAGE_CONTINUE, 10)[:4])
    with pytest.raises(MessageError):
        reader.receive_data(FRAME_HEADER.pack(Kind.MESSAGE_CONTINUE, 10)[4:])


def test_tampered_large_frame_fails():
    sealer = FrameSealer(Suite.AES_256_GCM, KEY)
    frame = bytearray(sealer.seal(Kind.TENSOR_DATA, os.urandom(5000)))
    frame[-1] ^= 1
    reader = FrameReader(FrameOpener(Suite.AES_256_GCM, KEY), capacity=CAPACITY)
    with pytest.raises(FrameAuthError):
        reader.receive_data(bytes(frame))
        reader.next_frame()


def test_connections_run_this_reader(make_transport, monkeypatch):
    """The class the tests above exercise is the one a live connection reads with."""
    made: list[FrameReader] = []

    class Recording(FrameReader):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            made.append(self)

    monkeypatch.setattr(connection_module, "FrameReader", Recording)
    inbox = Inbox()
    srv = make_transport(SERVER_IP)
    srv.serve(inbox.on_message)
    cli = make_transport(CLIENT_IP)
    cli.send(srv.identity, Kind.TENSOR_DATA, b"x" * 10)
    assert bytes(inbox.get().payload) == b"x" * 10
    assert len(made) == 2  # the client's outbound reader and the server's inbound one
    assert all(r.buffered == 0 for r in made)


def _send_in_pieces(sock: socket.socket, data: bytes, piece: int) -> None:
    for i in range(0, len(data), piece):
        sock.sendall(data[i : i + piece])


def test_socket_driver_with_short_receives():
    """A real socket pair, sender writing in odd pieces; the reader sees every split."""
    a, b = socket.socketpair()
    try:
        wire, sent = _wire(Suite.AES_256_GCM, [(Kind.TENSOR_DATA, 3000), (Kind.CONTROL, 0), (Kind.RPC_REQUEST, 70_000)], 65536)
        assembler = Assembler(PEER)
        reader = FrameReader(FrameOpener(Suite.AES_256_GCM, KEY), destination=assembler.destination, capacity=CAPACITY)
        writer = threading.Thread(target=_send_in_pieces, args=(a, wire, 777))
        writer.start()
        got = []
        while len(got) < len(sent):
            frame = reader.read_frame()
            if frame is None:
                view, exact = reader.recv_target()
                n = b.recv_into(view, len(view), socket.MSG_WAITALL if exact else 0)
                assert n
                reader.received(n)
            elif (msg := assembler.frame_done(*frame)) is not None:
                got.append((msg.kind, bytes(msg.payload)))
        writer.join(10)
        assert got == sent
    finally:
        a.close()
        b.close()
