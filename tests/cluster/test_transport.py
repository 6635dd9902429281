"""Transport behaviour over real sockets: messages, fragments, RPC, streams, pool, shutdown."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

import pytest

from mlxcel.cluster.errors import (
    ConnectionLost,
    HandshakeAborted,
    LocalProtocolError,
    PeerUnreachable,
    RequestFailed,
    RequestTimeout,
    SequenceExhausted,
    TransportClosed,
)
from mlxcel.cluster.identity import PeerId
from mlxcel.cluster.transport import Transport, TransportOptions
from mlxcel.cluster.wire import Kind, Suite

from .conftest import CLIENT_IP, SERVER_IP, Inbox, RawClient, wait_until

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("suite", list(Suite))
def test_messages_in_every_suite(make_transport, suite):
    inbox = Inbox()
    srv = make_transport(SERVER_IP, suite=suite)
    srv.serve(inbox.on_message, inbox.on_request)
    cli = make_transport(CLIENT_IP, suite=suite, chunk_len=4096)
    payloads = [b"", b"x", os.urandom(4096), os.urandom(4097), os.urandom(100_000)]
    for p in payloads:
        cli.send(srv.identity, Kind.TENSOR_DATA, p)
    for p in payloads:
        msg = inbox.get()
        assert bytes(msg.payload) == p and msg.kind == Kind.TENSOR_DATA
        assert msg.peer == cli.identity  # the handshake-bound identity, port included
    assert bytes(cli.request(srv.identity, b"hi")) == b"echo:hi"


def test_large_message_is_fragmented_and_reassembled(make_transport):
    inbox = Inbox()
    srv = make_transport(SERVER_IP)
    srv.serve(inbox.on_message, lambda m: bytes(m.payload[::-1]))
    cli = make_transport(CLIENT_IP, chunk_len=65536)
    big = os.urandom(3 * 1024 * 1024 + 7)
    cli.send(srv.identity, Kind.CONTROL, memoryview(big))
    msg = inbox.get()
    assert msg.kind == Kind.CONTROL and bytes(msg.payload) == big
    assert bytes(cli.request(srv.identity, big)) == big[::-1]


def test_rpc_errors_and_timeouts(make_transport):
    release = threading.Event()

    def on_request(msg):
        if bytes(msg.payload) == b"slow":
            release.wait(5)
            return b"late"
        raise KeyError("no such sequence")

    srv = make_transport(SERVER_IP)
    srv.serve(None, on_request)
    cli = make_transport(CLIENT_IP)
    with pytest.raises(RequestFailed, match="KeyError"):
        cli.request(srv.identity, b"x")
    with pytest.raises(RequestTimeout):
        cli.request(srv.identity, b"slow", timeout=0.2)
    release.set()
    with pytest.raises(RequestFailed):  # the late response was dropped, the connection still works
        cli.request(srv.identity, b"y")


def test_no_request_handler_answers_with_an_error(make_transport):
    srv = make_transport(SERVER_IP)
    srv.serve(lambda m: None)
    with pytest.raises(RequestFailed, match="serves no requests"):
        make_transport(CLIENT_IP).request(srv.identity, b"x")


def test_concurrent_requests_share_one_connection(make_transport):
    srv = make_transport(SERVER_IP)
    srv.serve(None, lambda m: bytes(m.payload) * 2)
    cli = make_transport(CLIENT_IP)
    results: dict[int, bytes] = {}

    def worker(i: int) -> None:
        for j in range(20):
            body = f"{i}-{j}".encode() * (1 + (j * 500) % 3000)
            results[(i, j)] = bytes(cli.request(srv.identity, body)) == body * 2

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(results) == 120 and all(results.values())
    assert srv.authenticated_connections == 1


def test_streams(make_transport):
    inbox = Inbox()
    srv = make_transport(SERVER_IP)
    srv.serve(inbox.on_message)
    cli = make_transport(CLIENT_IP)
    with cli.open_stream(srv.identity) as stream:
        stream.write(b"kv-0")
        stream.write(os.urandom(10_000))
    msgs = [inbox.get() for _ in range(3)]
    assert [m.kind for m in msgs] == [Kind.STREAM_DATA, Kind.STREAM_DATA, Kind.STREAM_END]
    assert len({m.id for m in msgs}) == 1 and msgs[-1].status == 0
    with pytest.raises(LocalProtocolError):
        stream.write(b"after close")


def test_streams_on_lanes_travel_on_their_own_connections_side_by_side(make_transport):
    inbox = Inbox()
    srv = make_transport(SERVER_IP)
    srv.serve(inbox.on_message)
    cli = make_transport(CLIENT_IP)
    first, second = cli.open_stream(srv.identity, 1), cli.open_stream(srv.identity, 2)
    assert first.connection is not second.connection
    assert wait_until(lambda: srv.authenticated_connections == 2)  # the server counts a connection once it is set up
    first.write(b"one-a")
    second.write(b"two-a")  # both streams open at once, each on its connection
    first.write(b"one-b")
    second.close()
    first.close()
    msgs = [inbox.get() for _ in range(5)]
    by_stream = {}
    for msg in msgs:
        by_stream.setdefault(msg.id, []).append((msg.kind, bytes(msg.payload)))
    assert by_stream == {first.id: [(Kind.STREAM_DATA, b"one-a"), (Kind.STREAM_DATA, b"one-b"), (Kind.STREAM_END, b"")],
                         second.id: [(Kind.STREAM_DATA, b"two-a"), (Kind.STREAM_END, b"")]}
    assert {m.peer for m in msgs} == {cli.identity}  # one authenticated sender, whatever the lane
    assert cli.open_stream(srv.identity, 1).connection is first.connection  # a lane's connection is pooled
    cli.send(srv.identity, Kind.CONTROL, b"lane 0")
    assert inbox.get().payload == b"lane 0" and wait_until(lambda: srv.authenticated_connections == 3)
    with pytest.raises(ValueError, match="lane"):
        cli.open_stream(srv.identity, -1)


def test_a_lost_lane_is_dialled_again_and_leaves_the_others(make_transport):
    inbox = Inbox()
    srv = make_transport(SERVER_IP)
    srv.serve(inbox.on_message)
    cli = make_transport(CLIENT_IP)
    lane0, lane1 = cli.connection(srv.identity), cli.open_stream(srv.identity, 1).connection
    lane1.close()
    assert wait_until(lambda: not lane1.alive)
    again = cli.open_stream(srv.identity, 1)
    assert again.connection is not lane1 and again.connection.alive and cli.connection(srv.identity) is lane0
    again.write(b"after")
    assert inbox.get().payload == b"after"


def test_handler_exception_does_not_kill_the_connection(make_transport, caplog):
    seen = []

    def on_message(msg):
        seen.append(bytes(msg.payload))
        if msg.payload == b"bad":
            raise RuntimeError("handler bug")

    srv = make_transport(SERVER_IP)
    srv.serve(on_message)
    cli = make_transport(CLIENT_IP)
    with caplog.at_level(logging.ERROR, "mlxcel.cluster"):
        cli.send(srv.identity, Kind.CONTROL, b"bad")
        cli.send(srv.identity, Kind.CONTROL, b"good")
        assert wait_until(lambda: seen == [b"bad", b"good"])


def test_send_rejects_non_message_kinds(make_transport):
    srv = make_transport(SERVER_IP)
    srv.serve(lambda m: None)
    with pytest.raises(LocalProtocolError):
        make_transport(CLIENT_IP).send(srv.identity, Kind.RPC_RESPONSE, b"x")


def test_reconnects_after_the_peer_restarts(make_transport, secret):
    inbox = Inbox()
    srv = make_transport(SERVER_IP)
    port = srv.serve(inbox.on_message).port
    cli = make_transport(CLIENT_IP)
    cli.send(srv.identity, Kind.CONTROL, b"1")
    inbox.get()
    srv.close()
    srv2 = Transport(f"{SERVER_IP}:{port}", secret)
    try:
        srv2.serve(inbox.on_message)
        assert wait_until(lambda: cli._pool.get(PeerId(SERVER_IP, port)) is None)
        cli.send(f"{SERVER_IP}:{port}", Kind.CONTROL, b"2")
        assert bytes(inbox.get().payload) == b"2"
    finally:
        srv2.close()


def test_unreachable_peer_after_backoff(make_transport):
    with socket.socket() as s:
        s.bind((SERVER_IP, 0))
        port = s.getsockname()[1]  # bound, not listening: connection refused
        cli = make_transport(CLIENT_IP, max_reconnect_attempts=2, reconnect_base_delay=0.01)
        with pytest.raises(PeerUnreachable, match="after 3 attempts") as info:
            cli.connect(f"{SERVER_IP}:{port}")
        assert isinstance(info.value.__cause__, ConnectionRefusedError)


def test_sequence_exhaustion_closes_the_connection(make_transport):
    inbox = Inbox()
    srv = make_transport(SERVER_IP)
    srv.serve(inbox.on_message)
    cli = make_transport(CLIENT_IP, seq_limit=3)
    for i in range(3):
        cli.send(srv.identity, Kind.CONTROL, b"%d" % i)
    with pytest.raises(SequenceExhausted):
        cli.send(srv.identity, Kind.CONTROL, b"3")
    assert [bytes(inbox.get().payload) for _ in range(3)] == [b"0", b"1", b"2"]
    cli.send(srv.identity, Kind.CONTROL, b"fresh")  # a new connection starts at sequence 0
    assert bytes(inbox.get().payload) == b"fresh"


def test_close_fails_pending_requests_and_is_idempotent(make_transport):
    gate = threading.Event()
    srv = make_transport(SERVER_IP)
    srv.serve(None, lambda m: gate.wait(5) and b"x")
    cli = make_transport(CLIENT_IP)
    errors = []

    def call():
        try:
            cli.request(srv.identity, b"x", timeout=10)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    t = threading.Thread(target=call)
    t.start()
    assert wait_until(lambda: srv.authenticated_connections == 1)
    cli.close()
    t.join(5)
    gate.set()
    assert len(errors) == 1 and isinstance(errors[0], ConnectionLost)
    cli.close()
    with pytest.raises(TransportClosed):
        cli.send(srv.identity, Kind.CONTROL, b"x")


def test_serve_port_zero_updates_identity_and_ipv6(make_transport, secret):
    srv = make_transport(SERVER_IP)
    ident = srv.serve(lambda m: None)
    assert ident.port != 0 and srv.identity == ident == srv.listen_address
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback")
    inbox = Inbox()
    v6 = Transport("[::1]:0", secret)
    v6c = Transport("[::1]:0", secret)
    try:
        v6.serve(inbox.on_message)
        v6c.send(v6.identity, Kind.CONTROL, b"six")
        msg = inbox.get()
        assert bytes(msg.payload) == b"six" and msg.peer.host == "::1"
    finally:
        v6c.close()
        v6.close()


def test_drop_closes_every_connection_to_and_from_one_peer_and_the_next_send_dials_afresh(make_transport):
    a_in, b_in, c_in = Inbox(), Inbox(), Inbox()
    a, b, c = make_transport(SERVER_IP), make_transport(CLIENT_IP), make_transport("127.0.0.4")
    for t, inbox in ((a, a_in), (b, b_in), (c, c_in)):
        t.serve(inbox.on_message)
    out0, out1 = a.connection(b.identity), a.open_stream(b.identity, 1).connection
    b.send(a.identity, Kind.CONTROL, b"b to a")  # b's own connection: inbound at a
    c.send(a.identity, Kind.CONTROL, b"c to a")
    assert {a_in.get().peer, a_in.get().peer} == {b.identity, c.identity}
    to_c, b_out = a.connection(c.identity), b.connection(a.identity)

    assert a.drop(b.identity) == 3  # two outbound lanes and the inbound one
    assert wait_until(lambda: not out0.alive and not out1.alive and a.authenticated_connections == 1)
    assert to_c.alive  # another peer's connections stay
    a.send(b.identity, Kind.CONTROL, b"after")
    assert b_in.get().payload == b"after" and a.connection(b.identity) not in (out0, out1)
    assert wait_until(lambda: not b_out.alive)
    b.send(a.identity, Kind.CONTROL, b"b again")  # b noticed its connection close and dials again
    assert a_in.get().payload == b"b again"
    assert a.drop(PeerId.of("127.0.0.9", 1)) == 0  # nobody: nothing to close


def test_both_directions_use_separate_connections(make_transport):
    a_in, b_in = Inbox(), Inbox()
    a = make_transport(SERVER_IP)
    b = make_transport(CLIENT_IP)
    a.serve(a_in.on_message)
    b.serve(b_in.on_message)
    a.send(b.identity, Kind.TENSOR_DATA, b"to-b")
    b.send(a.identity, Kind.TENSOR_DATA, b"to-a")
    assert b_in.get().peer == a.identity and a_in.get().peer == b.identity
    assert a.authenticated_connections == b.authenticated_connections == 1


def test_peer_reaching_its_last_sequence_number_is_an_orderly_close(make_transport, secret, raw_clients, caplog):
    """The receiving side of an exhausted direction closes at info, without a traceback."""
    inbox = Inbox()
    srv = make_transport(SERVER_IP, seq_limit=3)
    srv.serve(inbox.on_message)
    raw = RawClient(srv, secret).handshake()  # its own sealer does not stop at 3
    raw_clients.append(raw)
    with caplog.at_level(logging.DEBUG, "mlxcel.cluster"):
        raw.send(b"".join(raw.seal(Kind.CONTROL, b"%d" % i) for i in range(4)))
        assert [bytes(inbox.get().payload) for _ in range(3)] == [b"0", b"1", b"2"]
        assert raw.closed_by_peer()
        assert wait_until(lambda: any("last sequence number" in r.getMessage() for r in caplog.records))
    closing = [r for r in caplog.records if "last sequence number" in r.getMessage()]
    assert [r.levelno for r in closing] == [logging.INFO] and closing[0].exc_info is None
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert inbox.q.empty()


def test_sending_side_exhaustion_logs_no_error(make_transport, caplog):
    inbox = Inbox()
    srv = make_transport(SERVER_IP)
    srv.serve(inbox.on_message)
    cli = make_transport(CLIENT_IP, seq_limit=1)
    with caplog.at_level(logging.DEBUG, "mlxcel.cluster"):
        cli.send(srv.identity, Kind.CONTROL, b"only")
        with pytest.raises(SequenceExhausted):
            cli.send(srv.identity, Kind.CONTROL, b"one too many")
        assert bytes(inbox.get().payload) == b"only"
        assert wait_until(lambda: srv.authenticated_connections == 0)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    assert any(r.levelno == logging.INFO and "last sequence number" in r.getMessage() for r in caplog.records)


def _hold_pending_pool(srv: Transport, ip: str, n: int) -> list[socket.socket]:
    """Idle sockets from ``ip`` that fill its share of the pending pool until the
    server's handshake timeout closes them."""
    held = [socket.create_connection(srv.identity.address, source_address=(ip, 0)) for _ in range(n)]
    assert wait_until(lambda: srv.pending_handshakes == n)
    return held


def test_full_pending_pool_delays_a_dial_instead_of_failing_it(make_transport, secret):
    """The dial budget covers the handshake timeout, so it outlasts a full pending pool."""
    srv = make_transport(SERVER_IP, handshake_timeout=1.0, max_pending_handshakes_per_ip=2)
    srv.serve(None, lambda m: b"ok")
    held = _hold_pending_pool(srv, CLIENT_IP, 2)
    try:
        # the attempt count alone (one retry after 50 ms) would give up long before 1 s
        cli = make_transport(CLIENT_IP, handshake_timeout=1.0, max_reconnect_attempts=1, reconnect_base_delay=0.05, reconnect_budget=None)
        assert cli.options.dial_budget == 3.0
        start = time.monotonic()
        assert cli.connect(srv.identity) is True
        assert 0.5 < time.monotonic() - start < 3.0
        assert bytes(cli.request(srv.identity, b"x")) == b"ok"
    finally:
        for s in held:
            s.close()


def test_dial_budget_zero_keeps_the_attempt_count_alone(make_transport):
    srv = make_transport(SERVER_IP, handshake_timeout=2.0, max_pending_handshakes_per_ip=1)
    srv.serve(None, lambda m: b"ok")
    held = _hold_pending_pool(srv, CLIENT_IP, 1)
    try:
        cli = make_transport(CLIENT_IP, max_reconnect_attempts=1, reconnect_base_delay=0.05, reconnect_budget=0)
        start = time.monotonic()
        with pytest.raises(PeerUnreachable, match="after 2 attempts") as info:
            cli.connect(srv.identity)
        assert time.monotonic() - start < 1.0
        assert isinstance(info.value.__cause__, (HandshakeAborted, ConnectionError))
    finally:
        for s in held:
            s.close()


def test_default_dial_budget_outlasts_the_handshake_timeout():
    opts = TransportOptions()
    assert opts.reconnect_budget is None and opts.dial_budget == opts.handshake_timeout + 2.0 == 7.0
    assert TransportOptions(reconnect_budget=0).dial_budget == 0
