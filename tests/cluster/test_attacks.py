"""Attacks over real loopback sockets; after each one the listener still serves an honest peer."""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time

import pytest

from mlxcel.cluster.errors import (
    IdentityRejected,
    PeerUnreachable,
    SecretMismatch,
    ServerAtCapacity,
    SuiteMismatch,
    VerdictNotVerified,
    VersionMismatch,
)
from mlxcel.cluster.handshake import MSG_AT_CAPACITY, MSG_CLOSED_AFTER_AUTH, MSG_VERDICT_FORGED, encode_client_hello
from mlxcel.cluster.transport import Transport
from mlxcel.cluster.wire import FRAME_HEADER, MAGIC, PROTOCOL_VERSION, RECORD_PREFIX, Channel, Kind, Record, RejectReason, Suite

from .conftest import CLIENT_IP, HONEST_IP, SERVER_IP, RawClient, assert_serves, wait_until

pytestmark = [pytest.mark.timeout(60), pytest.mark.proc]


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def _has(caplog: pytest.LogCaptureFixture, text: str) -> bool:
    return any(text in r.getMessage() for r in caplog.records)


# --- handshake attacks ----------------------------------------------------------------


def test_wrong_secret_on_the_connecting_side(server, make_transport, secret, other_secret, caplog):
    srv, _ = server
    intruder = make_transport(CLIENT_IP, other_secret)
    with caplog.at_level(logging.DEBUG, "mlxcel.cluster"):
        with pytest.raises(SecretMismatch, match=r"its authenticator does not verify under the configured cluster secret \(secret mismatch\)"):
            intruder.connect(srv.identity)
        assert wait_until(lambda: _has(caplog, MSG_CLOSED_AFTER_AUTH))
    assert srv.authenticated_connections == 0
    assert_serves(srv, secret)


def test_wrong_secret_on_the_accepting_side(make_transport, secret, other_secret):
    rogue = make_transport(SERVER_IP, other_secret)
    got = []
    rogue.serve(got.append, lambda m: b"stolen")
    client = make_transport(CLIENT_IP)
    with pytest.raises(SecretMismatch, match="secret mismatch"):
        client.request(rogue.identity, b"prompt", timeout=2)
    assert got == [] and rogue.authenticated_connections == 0


def test_client_that_fakes_its_authenticator(server, secret, other_secret, raw_clients, caplog):
    srv, inbox = server
    raw = RawClient(srv, secret)
    raw_clients.append(raw)
    raw.send(raw.hs.hello())
    # read the server hello, then answer with an authenticator made under another secret
    data = b""
    while len(data) < 72:
        data += raw.sock.recv(72 - len(data))
    from mlxcel.cluster.handshake import ClientHandshake

    forged = ClientHandshake(other_secret, f"{CLIENT_IP}:1", nonce=raw.hs.nonce)
    forged.hello()
    forged._server_hello = data  # the forger cannot verify the server; it guesses
    forged.state = "SERVER_VERIFIED"
    with caplog.at_level(logging.WARNING, "mlxcel.cluster"):
        raw.send(forged.client_auth())
        assert raw.closed_by_peer()  # no verdict for an unauthenticated client
        assert wait_until(lambda: _has(caplog, "client's authenticator does not verify"))
    assert inbox.q.empty()
    assert_serves(srv, secret)


def test_identity_not_owned(server, make_transport, secret, caplog):
    srv, _ = server
    # advertises 127.0.0.5 but connects from 127.0.0.1 (no outbound bind)
    liar = make_transport("127.0.0.5", bind_outbound=False)
    with caplog.at_level(logging.WARNING, "mlxcel.cluster"):
        with pytest.raises(IdentityRejected) as info:
            liar.connect(srv.identity)
        assert str(info.value) == (
            "server refused this node's advertised identity 127.0.0.5:0: the advertised IP must be the "
            "address the server sees this connection come from"
        )
        assert wait_until(lambda: _has(caplog, "refusing to bind a listener address the peer does not own"))
    assert_serves(srv, secret)


def test_identity_rejection_comes_before_any_server_nonce(server, secret):
    srv, _ = server
    with socket.create_connection(srv.identity.address, source_address=(CLIENT_IP, 0)) as s:
        s.sendall(encode_client_hello(Suite.AES_256_GCM, Channel.TRANSPORT, bytes(32), "127.0.0.99:7"))
        s.settimeout(3)
        reply = b""
        while chunk := s.recv(100):
            reply += chunk
    assert reply == RECORD_PREFIX.pack(MAGIC, PROTOCOL_VERSION, Record.REJECT) + bytes([RejectReason.IDENTITY, 0])
    assert_serves(srv, secret)


def test_identity_that_is_not_a_socket_address_is_closed_without_a_record(server, secret, caplog):
    srv, _ = server
    with caplog.at_level(logging.WARNING, "mlxcel.cluster"):
        with socket.create_connection(srv.identity.address, source_address=(CLIENT_IP, 0)) as s:
            s.sendall(encode_client_hello(Suite.AES_256_GCM, Channel.TRANSPORT, bytes(32), "not-an-address"))
            s.settimeout(3)
            assert s.recv(100) == b""
        assert wait_until(lambda: _has(caplog, "not a socket address"))
    assert_serves(srv, secret)


def test_suite_mismatch(server, make_transport, secret, caplog):
    srv, _ = server
    client = make_transport(CLIENT_IP, suite=Suite.CHACHA20_POLY1305)
    with caplog.at_level(logging.WARNING, "mlxcel.cluster"):
        with pytest.raises(SuiteMismatch, match="server requires frame suite aes-256-gcm, this node is configured for chacha20-poly1305"):
            client.connect(srv.identity)
        assert wait_until(lambda: _has(caplog, "suite mismatch"))
    assert_serves(srv, secret)


def test_channel_mismatch(server, make_transport, secret):
    srv, _ = server
    client = make_transport(CLIENT_IP, channel=Channel.ASSIGNMENT)
    with pytest.raises(Exception, match="channel"):
        client.connect(srv.identity)
    assert_serves(srv, secret)


def test_version_mismatch_client_too_old(server, secret):
    srv, _ = server
    hello = bytearray(encode_client_hello(Suite.AES_256_GCM, Channel.TRANSPORT, bytes(32), f"{CLIENT_IP}:1"))
    struct.pack_into(">H", hello, 4, 4)
    with socket.create_connection(srv.identity.address, source_address=(CLIENT_IP, 0)) as s:
        s.sendall(hello)
        s.settimeout(3)
        reply = s.recv(100)
    assert reply[6] == Record.REJECT and reply[7] == RejectReason.VERSION
    assert struct.unpack(">H", reply[4:6])[0] == PROTOCOL_VERSION
    assert_serves(srv, secret)


def _fake_server(reply: bytes) -> tuple[socket.socket, threading.Thread]:
    lsock = socket.socket()
    lsock.bind((SERVER_IP, 0))
    lsock.listen()

    def run() -> None:
        conn, _ = lsock.accept()
        with conn:
            conn.recv(1024)
            conn.sendall(reply)
            conn.settimeout(2)
            try:
                conn.recv(1024)
            except OSError:
                pass

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return lsock, t


def test_version_mismatch_server_too_new(make_transport):
    lsock, t = _fake_server(RECORD_PREFIX.pack(MAGIC, 6, Record.SERVER_HELLO) + bytes(65))
    try:
        client = make_transport(CLIENT_IP)
        with pytest.raises(VersionMismatch, match="server speaks cluster protocol version 6, this node speaks 5"):
            client.connect("%s:%d" % lsock.getsockname())
    finally:
        t.join(5)
        lsock.close()


def test_bad_magic_and_malformed_hellos(server, secret, caplog):
    srv, _ = server
    junk = [
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        RECORD_PREFIX.pack(MAGIC, PROTOCOL_VERSION, Record.CLIENT_AUTH) + bytes(40),
        RECORD_PREFIX.pack(MAGIC, PROTOCOL_VERSION, Record.CLIENT_HELLO) + bytes([Suite.AES_256_GCM, 0]) + bytes(32) + bytes([0]),
        b"\x00" * 300,
    ]
    with caplog.at_level(logging.WARNING, "mlxcel.cluster"):
        for payload in junk:
            with socket.create_connection(srv.identity.address, source_address=(CLIENT_IP, 0)) as s:
                s.sendall(payload)
                s.settimeout(3)
                try:
                    assert s.recv(100) == b""
                except ConnectionResetError:
                    pass
        assert wait_until(lambda: _has(caplog, "bad magic"))
    assert_serves(srv, secret)


def test_liveness_probe_is_logged_at_debug_only(server, secret, caplog):
    srv, _ = server
    with caplog.at_level(logging.DEBUG, "mlxcel.cluster"):
        socket.create_connection(srv.identity.address, source_address=(CLIENT_IP, 0)).close()
        assert wait_until(lambda: _has(caplog, "closed before the handshake"))
        assert not _warnings(caplog)
    assert_serves(srv, secret)


def test_stall_to_the_handshake_timeout(server, secret, caplog):
    srv, _ = server  # handshake_timeout=1.0 in the fixture
    with caplog.at_level(logging.WARNING, "mlxcel.cluster"):
        with socket.create_connection(srv.identity.address, source_address=(CLIENT_IP, 0)) as s:
            s.sendall(encode_client_hello(Suite.AES_256_GCM, Channel.TRANSPORT, bytes(32), f"{CLIENT_IP}:1")[:20])
            start = time.monotonic()
            s.settimeout(5)
            assert s.recv(100) == b""
            elapsed = time.monotonic() - start
        assert 0.8 <= elapsed < 3.0
        assert wait_until(lambda: _has(caplog, "did not complete within 1s"))
    assert srv.pending_handshakes == 0
    assert_serves(srv, secret)


def test_default_handshake_timeout_is_five_seconds(secret):
    from mlxcel.cluster.transport import TransportOptions
    from mlxcel.cluster.wire import HANDSHAKE_TIMEOUT_S

    assert HANDSHAKE_TIMEOUT_S == 5.0
    assert TransportOptions().handshake_timeout == 5.0
    t = Transport(f"{SERVER_IP}:0", secret)
    assert t.options.handshake_timeout == 5.0
    t.close()


# --- capacity and verdict -------------------------------------------------------------


def test_at_capacity_is_retried_then_reported(make_transport, secret, caplog):
    srv = make_transport(SERVER_IP, max_connections=1)
    srv.serve(lambda m: None, lambda m: b"ok")
    first = make_transport(CLIENT_IP)
    first.connect(srv.identity)
    second = make_transport(HONEST_IP, max_reconnect_attempts=2, reconnect_base_delay=0.01)
    with caplog.at_level(logging.WARNING, "mlxcel.cluster"):
        with pytest.raises(PeerUnreachable) as info:
            second.request(srv.identity, b"x", timeout=2)
        assert isinstance(info.value.__cause__, ServerAtCapacity)
        assert str(info.value.__cause__) == MSG_AT_CAPACITY
        assert _has(caplog, "max connections (1) reached")
        assert _has(caplog, "is at capacity; retrying")
        assert second.connect(srv.identity) is False  # connect() warns and continues
    # a slot freed during the backoff budget is reached by the same acquire
    second2 = make_transport("127.0.0.6", max_reconnect_attempts=8, reconnect_base_delay=0.05)
    threading.Timer(0.15, first.close).start()
    assert bytes(second2.request(srv.identity, b"x", timeout=5)) == b"ok"


class _VerdictFlipper:
    """A relay on the path that rewrites the verdict byte (it cannot fix the MAC)."""

    def __init__(self, target: tuple[str, int], source_ip: str) -> None:
        self.lsock = socket.socket()
        self.lsock.bind((SERVER_IP, 0))
        self.lsock.listen()
        self.target, self.source_ip = target, source_ip
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    @property
    def address(self) -> str:
        return "%s:%d" % self.lsock.getsockname()

    def _run(self) -> None:
        c, _ = self.lsock.accept()
        s = socket.create_connection(self.target, source_address=(self.source_ip, 0))
        with c, s:
            hello = c.recv(4096)
            s.sendall(hello)
            c.sendall(_recv_n(s, 72))
            s.sendall(_recv_n(c, 39))
            verdict = bytearray(_recv_n(s, 40))
            verdict[7] ^= 1
            c.sendall(verdict)
            c.settimeout(2)
            try:
                c.recv(10)
            except OSError:
                pass


def _recv_n(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            raise EOFError
        out += chunk
    return out


@pytest.mark.parametrize("capacity", [1, 0], ids=["accept-to-at-capacity", "at-capacity-to-accept"])
def test_altered_verdict(make_transport, secret, capacity):
    srv = make_transport(SERVER_IP, max_connections=capacity)
    srv.serve(lambda m: None, lambda m: b"ok")
    relay = _VerdictFlipper(srv.identity.address, CLIENT_IP)
    client = make_transport(CLIENT_IP)
    with pytest.raises(VerdictNotVerified) as info:
        client.connect(relay.address)
    assert str(info.value) == MSG_VERDICT_FORGED
    relay.thread.join(5)
    relay.lsock.close()
    if capacity:
        assert_serves(srv, secret)


# --- frame attacks (authenticated raw client) --------------------------------------------


def _auth_raw(srv: Transport, secret, raw_clients, ip: str = CLIENT_IP) -> RawClient:
    raw = RawClient(srv, secret, ip).handshake()
    raw_clients.append(raw)
    return raw


def test_honest_raw_frames_are_delivered(server, secret, raw_clients):
    srv, inbox = server
    raw = _auth_raw(srv, secret, raw_clients)
    raw.send(raw.seal(Kind.TENSOR_DATA, b"activation"))
    msg = inbox.get()
    assert bytes(msg.payload) == b"activation" and str(msg.peer) == f"{CLIENT_IP}:1"


@pytest.mark.parametrize("where", ["header-kind", "header-len", "payload", "tag"])
def test_tampered_frame_closes_the_connection(server, secret, raw_clients, caplog, where):
    srv, inbox = server
    raw = _auth_raw(srv, secret, raw_clients)
    frame = bytearray(raw.seal(Kind.TENSOR_DATA, b"A" * 64))
    index = {"header-kind": 0, "header-len": 4, "payload": 10, "tag": len(frame) - 1}[where]
    frame[index] ^= 0x01 if where != "header-len" else 0x02  # len 64 -> 66: reads 2 bytes more
    with caplog.at_level(logging.WARNING, "mlxcel.cluster"):
        raw.send(bytes(frame) + b"\x00" * 2)
        assert raw.closed_by_peer()
        assert wait_until(lambda: _has(caplog, "failed authentication"))
    assert inbox.q.empty()
    assert_serves(srv, secret)


def test_replayed_frame(server, secret, raw_clients, caplog):
    srv, inbox = server
    raw = _auth_raw(srv, secret, raw_clients)
    frame = raw.seal(Kind.CONTROL, b"shutdown")
    with caplog.at_level(logging.WARNING, "mlxcel.cluster"):
        raw.send(frame + frame)
        assert bytes(inbox.get().payload) == b"shutdown"
        assert raw.closed_by_peer()
        assert wait_until(lambda: _has(caplog, "failed authentication"))
    assert inbox.q.empty()
    assert_serves(srv, secret)


def test_reordered_frames(server, secret, raw_clients):
    srv, inbox = server
    raw = _auth_raw(srv, secret, raw_clients)
    first, second = raw.seal(Kind.CONTROL, b"one"), raw.seal(Kind.CONTROL, b"two")
    raw.send(second + first)
    assert raw.closed_by_peer()
    assert inbox.q.empty()
    assert_serves(srv, secret)


def test_frame_recorded_on_another_connection(server, secret, raw_clients):
    srv, inbox = server
    a = _auth_raw(srv, secret, raw_clients)
    b = _auth_raw(srv, secret, raw_clients)
    b.send(a.seal(Kind.CONTROL, b"from-a"))  # same sequence number 0, other keys
    assert b.closed_by_peer()
    assert inbox.q.empty()
    assert_serves(srv, secret)


def test_oversize_length_is_refused_from_the_header(server, secret, raw_clients, caplog):
    srv, inbox = server
    raw = _auth_raw(srv, secret, raw_clients)
    with caplog.at_level(logging.WARNING, "mlxcel.cluster"):
        raw.send(FRAME_HEADER.pack(Kind.TENSOR_DATA, 0xFFFFFFFF))  # no body follows
        assert raw.closed_by_peer(timeout=2)  # it did not wait for (or allocate) 4 GiB
        assert wait_until(lambda: _has(caplog, "above the cap of 268435456"))
    assert_serves(srv, secret)


def test_unknown_kind(server, secret, raw_clients, caplog):
    srv, inbox = server
    raw = _auth_raw(srv, secret, raw_clients)
    with caplog.at_level(logging.WARNING, "mlxcel.cluster"):
        raw.send(raw.seal(0x7E, b"future"))
        assert raw.closed_by_peer()
        assert wait_until(lambda: _has(caplog, "unknown kind 0x7e"))
    assert inbox.q.empty()
    assert_serves(srv, secret)


def test_bad_fragment_sequence(server, secret, raw_clients):
    srv, inbox = server
    raw = _auth_raw(srv, secret, raw_clients)
    raw.send(raw.seal(Kind.MESSAGE_CONTINUE, b"orphan"))
    assert raw.closed_by_peer()
    assert_serves(srv, secret)


def test_unauthenticated_frames_never_reach_the_handler(server, secret, raw_clients):
    srv, inbox = server
    with socket.create_connection(srv.identity.address, source_address=(CLIENT_IP, 0)) as s:
        s.sendall(FRAME_HEADER.pack(Kind.CONTROL, 4) + b"kill")
        assert _closed_at_accept(s, 3.0)
    assert inbox.q.empty()
    assert_serves(srv, secret)


# --- pending pool floods ---------------------------------------------------------------------


def _open_idle(ip: str, target: tuple[str, int], n: int) -> list[socket.socket]:
    return [socket.create_connection(target, source_address=(ip, 0)) for _ in range(n)]


def _closed_at_accept(s: socket.socket, timeout: float = 1.0) -> bool:
    s.settimeout(timeout)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def test_pending_pool_flood_from_one_source(make_transport, secret, caplog):
    srv = make_transport(SERVER_IP, handshake_timeout=3.0)
    srv.serve(lambda m: None, lambda m: b"echo:" + bytes(m.payload))
    flood = _open_idle(CLIENT_IP, srv.identity.address, 8)
    try:
        assert wait_until(lambda: srv.pending_handshakes == 8)
        with caplog.at_level(logging.WARNING, "mlxcel.cluster"):
            extra = _open_idle(CLIENT_IP, srv.identity.address, 2)
            flood += extra
            assert all(_closed_at_accept(s) for s in extra)
            assert _has(caplog, "pending handshake pool full")
        assert_serves(srv, secret, HONEST_IP)  # another source is unaffected
    finally:
        for s in flood:
            s.close()
    assert wait_until(lambda: srv.pending_handshakes == 0)
    assert_serves(srv, secret, CLIENT_IP)  # the source recovers once its slots free


def test_pending_pool_flood_from_many_sources(make_transport, secret):
    srv = make_transport(SERVER_IP, handshake_timeout=3.0)
    srv.serve(lambda m: None, lambda m: b"echo:" + bytes(m.payload))
    flood: list[socket.socket] = []
    try:
        for i in range(8):
            flood += _open_idle(f"127.0.1.{i + 1}", srv.identity.address, 8)
        assert wait_until(lambda: srv.pending_handshakes == 64)
        late = _open_idle("127.0.2.1", srv.identity.address, 1)
        flood += late
        assert _closed_at_accept(late[0])
        assert srv.authenticated_connections == 0
    finally:
        for s in flood:
            s.close()
    assert wait_until(lambda: srv.pending_handshakes == 0)
    assert_serves(srv, secret)


def test_flood_cannot_take_established_slots(make_transport, secret):
    srv = make_transport(SERVER_IP, handshake_timeout=3.0, max_pending_handshakes=4, max_pending_handshakes_per_ip=4)
    srv.serve(lambda m: None, lambda m: b"echo:" + bytes(m.payload))
    member = make_transport(HONEST_IP)
    assert bytes(member.request(srv.identity, b"a")) == b"echo:a"
    flood = _open_idle(CLIENT_IP, srv.identity.address, 6)
    try:
        assert bytes(member.request(srv.identity, b"b")) == b"echo:b"
    finally:
        for s in flood:
            s.close()


def test_reset_after_the_server_authenticator_counts_as_secret_mismatch(server, secret, other_secret, caplog):
    srv, _ = server
    with caplog.at_level(logging.WARNING, "mlxcel.cluster"):
        s = socket.create_connection(srv.identity.address, source_address=(CLIENT_IP, 0))
        s.sendall(encode_client_hello(Suite.AES_256_GCM, Channel.TRANSPORT, bytes(32), f"{CLIENT_IP}:1"))
        assert len(_recv_n(s, 72)) == 72
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()  # RST instead of FIN
        assert wait_until(lambda: _has(caplog, MSG_CLOSED_AFTER_AUTH))
    assert_serves(srv, secret)


def test_assignment_channel_options_and_isolation(make_transport, secret):
    from mlxcel.cluster.transport import TransportOptions

    opts = TransportOptions.for_assignment()
    assert (opts.channel, opts.max_pending_handshakes, opts.max_pending_handshakes_per_ip) == (Channel.ASSIGNMENT, 8, 4)
    peer = make_transport(SERVER_IP, options=opts)
    got = []
    peer.serve(got.append, lambda m: b"accepted")
    coordinator = make_transport(CLIENT_IP, options=TransportOptions.for_assignment())
    assert bytes(coordinator.request(peer.identity, b"offer")) == b"accepted"
    stage_traffic = make_transport(HONEST_IP)  # transport channel cannot talk to the assignment listener
    with pytest.raises(Exception, match="channel"):
        stage_traffic.connect(peer.identity)
