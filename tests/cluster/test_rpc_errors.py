"""Typed RPC errors: codes travel in the documented error body and come back as RequestFailed.code."""

from __future__ import annotations

import struct

import pytest

from mlxcel.cluster.errors import RequestError, RequestFailed
from mlxcel.cluster.messages import decode_error, encode_error
from mlxcel.cluster.reader import FrameReader
from mlxcel.cluster.wire import MAX_ERROR_TEXT, RPC_ERROR, STREAM_ABORTED, ErrorCode, Kind

from .conftest import CLIENT_IP, HONEST_IP, SERVER_IP, Inbox, RawClient

pytestmark = pytest.mark.timeout(60)


def _failing_server(make_transport):
    def on_request(msg):
        body = bytes(msg.payload)
        if body == b"missing":
            raise RequestError(ErrorCode.NOT_FOUND, "no sequence 7 on this stage")
        if body == b"busy":
            raise RequestError(ErrorCode.OVERLOADED, "queue full")
        if body == b"slow":
            raise TimeoutError("stage step deadline passed")
        raise KeyError("bug")

    srv = make_transport(SERVER_IP)
    srv.serve(None, on_request)
    return srv


@pytest.mark.parametrize(
    "body, code, detail",
    [
        (b"missing", ErrorCode.NOT_FOUND, "no sequence 7 on this stage"),
        (b"busy", ErrorCode.OVERLOADED, "queue full"),
        (b"slow", ErrorCode.TIMEOUT, "TimeoutError: stage step deadline passed"),
        (b"other", ErrorCode.INTERNAL, "KeyError: 'bug'"),
    ],
)
def test_handler_errors_carry_their_code(make_transport, body, code, detail):
    srv = _failing_server(make_transport)
    cli = make_transport(CLIENT_IP)
    with pytest.raises(RequestFailed) as info:
        cli.request(srv.identity, body)
    assert info.value.code is code and info.value.detail == detail
    assert code.name in str(info.value) and str(srv.identity) in str(info.value)


def test_no_request_handler_is_unsupported(make_transport):
    srv = make_transport(SERVER_IP)
    srv.serve(lambda m: None)
    with pytest.raises(RequestFailed) as info:
        make_transport(CLIENT_IP).request(srv.identity, b"x")
    assert info.value.code is ErrorCode.UNSUPPORTED


def test_forwarded_failure_keeps_the_downstream_code(make_transport):
    """A handler that relays a request and lets RequestFailed escape answers with its code."""

    def refuse(msg):
        raise RequestError(ErrorCode.UNAUTHORIZED, "not the coordinator")

    last = make_transport(SERVER_IP)
    last.serve(None, refuse)
    middle = make_transport(HONEST_IP)
    middle.serve(None, lambda msg: middle.request(last.identity, bytes(msg.payload), timeout=5))
    cli = make_transport(CLIENT_IP)
    with pytest.raises(RequestFailed) as info:
        cli.request(middle.identity, b"x")
    assert info.value.code is ErrorCode.UNAUTHORIZED and info.value.detail == "not the coordinator"


def test_error_body_on_the_wire(server, secret, raw_clients):
    """RPC_RESPONSE = request id (8) || status (1) || code (u16 BE) || UTF-8 text."""
    srv, _ = server  # its handler raises ValueError for b"boom"
    raw = RawClient(srv, secret).handshake()
    raw_clients.append(raw)
    raw.send(raw.seal(Kind.RPC_REQUEST, struct.pack(">Q", 42) + b"boom"))
    reader = FrameReader(raw.opener)
    raw.sock.settimeout(5)
    while (frame := reader.next_frame()) is None:
        reader.receive_data(raw.sock.recv(4096))
    assert frame.kind == Kind.RPC_RESPONSE
    assert frame.payload[:11] == struct.pack(">QBH", 42, RPC_ERROR, ErrorCode.INTERNAL)
    assert frame.payload[11:] == b"ValueError: handler exploded"


def test_error_body_codec():
    assert encode_error(ErrorCode.BAD_REQUEST, "shape") == b"\x00\x02shape"
    doc_example = "000000000000002a 01 0004 6e6f2073657175656e6365"  # docs/protocol.md §5.1
    assert struct.pack(">QB", 42, RPC_ERROR) + encode_error(ErrorCode.NOT_FOUND, "no sequence") == bytes.fromhex(doc_example)
    assert decode_error(b"\x00\x04gone") == (ErrorCode.NOT_FOUND, "gone")
    assert decode_error(b"\x7f\x00from a newer peer") == (ErrorCode.UNKNOWN, "from a newer peer")
    assert decode_error(b"\x01") == (ErrorCode.UNKNOWN, "")
    long = encode_error(ErrorCode.INTERNAL, "\u00e9" * 2000)  # 2-byte characters, cut on a boundary
    assert len(long) <= 2 + MAX_ERROR_TEXT and decode_error(long)[1] == "\u00e9" * (MAX_ERROR_TEXT // 2)


def test_aborted_stream_carries_a_code(make_transport):
    inbox = Inbox()
    srv = make_transport(SERVER_IP)
    srv.serve(inbox.on_message)
    cli = make_transport(CLIENT_IP)
    with pytest.raises(RequestError):
        with cli.open_stream(srv.identity) as stream:
            stream.write(b"kv block 0")
            raise RequestError(ErrorCode.CANCELLED, "client went away")
    with cli.open_stream(srv.identity) as stream:
        stream.write(b"kv block 0")
    data, end, data2, end2 = (inbox.get() for _ in range(4))
    assert end.kind == Kind.STREAM_END and end.status == STREAM_ABORTED
    assert decode_error(end.payload) == (ErrorCode.CANCELLED, "client went away")
    assert end2.status == 0 and bytes(end2.payload) == b""
