"""Sans-I/O handshake: order enforcement, byte-at-a-time, mismatches, transcript binding."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlxcel.cluster.errors import (
    IdentityRejected,
    LocalProtocolError,
    MalformedHandshake,
    SecretMismatch,
    ServerAtCapacity,
    SuiteMismatch,
    VerdictNotVerified,
    VersionMismatch,
)
from mlxcel.cluster.handshake import (
    NEED_DATA,
    ClientHandshake,
    ClientVerified,
    Established,
    HelloReceived,
    Rejected,
    ServerHandshake,
    ServerVerified,
)
from mlxcel.cluster.identity import PeerId, bind_identity, source_key
from mlxcel.cluster.secret import ClusterSecret
from mlxcel.cluster.wire import Channel, Suite

SECRET = ClusterSecret(b"s" * 32)
OTHER = ClusterSecret(b"o" * 32)


def feed(machine, data: bytes, step: int | None = None) -> object:
    """Feed bytes (optionally ``step`` at a time) and return the first event."""
    step = step or len(data) or 1
    event = machine.next_event()
    for i in range(0, len(data), step):
        assert event is NEED_DATA
        machine.receive_data(data[i : i + step])
        event = machine.next_event()
    return event


def run(client: ClientHandshake, server: ServerHandshake, accept: bool = True, step: int | None = None) -> tuple[object, object]:
    ev = feed(server, client.hello(), step)
    assert isinstance(ev, HelloReceived)
    ev = feed(client, server.server_hello(), step)
    assert isinstance(ev, ServerVerified)
    ev = feed(server, client.client_auth(), step)
    assert isinstance(ev, ClientVerified)
    return ev, feed(client, server.verdict(accept), step)


def test_full_handshake_agrees_on_keys():
    client = ClientHandshake(SECRET, "10.0.0.2:9000")
    server = ServerHandshake(SECRET, "10.0.0.2")
    verified, est = run(client, server)
    assert verified.peer == PeerId("10.0.0.2", 9000)
    assert isinstance(est, Established)
    s = server.established()
    assert (est.send_key, est.recv_key) == (s.recv_key, s.send_key)
    assert est.send_key != est.recv_key
    assert "key" not in repr(est).lower() or "redacted" in repr(est)


@settings(max_examples=30, deadline=None)
@given(step=st.integers(1, 80))
def test_any_split_of_the_records(step):
    _, est = run(ClientHandshake(SECRET, "10.0.0.2:1"), ServerHandshake(SECRET, "10.0.0.2"), step=step)
    assert isinstance(est, Established)


def test_bytes_needed_never_overreads():
    client = ClientHandshake(SECRET, "10.0.0.2:1")
    server = ServerHandshake(SECRET, "10.0.0.2")
    hello = client.hello()
    got = 0
    while server.next_event() is NEED_DATA:
        n = server.bytes_needed()
        assert 0 < n <= len(hello) - got
        server.receive_data(hello[got : got + n])
        got += n
    assert got == len(hello)


def test_call_order_is_enforced():
    client = ClientHandshake(SECRET, "10.0.0.2:1")
    with pytest.raises(LocalProtocolError):
        client.client_auth()
    client.hello()
    with pytest.raises(LocalProtocolError):
        client.hello()
    server = ServerHandshake(SECRET, "10.0.0.2")
    with pytest.raises(LocalProtocolError):
        server.server_hello()
    with pytest.raises(LocalProtocolError):
        server.verdict(True)
    with pytest.raises(LocalProtocolError):
        _ = server.keys


def test_wrong_secret_detected_by_the_client_first():
    client = ClientHandshake(OTHER, "10.0.0.2:1")
    server = ServerHandshake(SECRET, "10.0.0.2")
    feed(server, client.hello())
    with pytest.raises(SecretMismatch, match=r"its authenticator does not verify under the configured cluster secret \(secret mismatch\)"):
        feed(client, server.server_hello())
    assert client.state == "ERROR"
    with pytest.raises(LocalProtocolError):
        client.next_event()
    assert "after receiving this server's authenticator" in str(server.connection_closed())


def test_wrong_client_authenticator_detected_by_the_server():
    honest = ClientHandshake(SECRET, "10.0.0.2:1")
    server = ServerHandshake(SECRET, "10.0.0.2")
    feed(server, honest.hello())
    feed(honest, server.server_hello())
    auth = bytearray(honest.client_auth())
    auth[-1] ^= 1
    with pytest.raises(SecretMismatch, match="client's authenticator does not verify"):
        feed(server, bytes(auth))


def test_suite_byte_altered_on_the_path_fails_both_authenticators():
    client = ClientHandshake(SECRET, "10.0.0.2:1", suite=Suite.AES_256_GCM)
    server = ServerHandshake(SECRET, "10.0.0.2", suite=Suite.CHACHA20_POLY1305)
    hello = bytearray(client.hello())
    hello[7] = Suite.CHACHA20_POLY1305  # downgrade attempt
    assert isinstance(feed(server, bytes(hello)), HelloReceived)
    reply = bytearray(server.server_hello())
    reply[7] = Suite.AES_256_GCM
    with pytest.raises(SecretMismatch):
        feed(client, bytes(reply))


def test_suite_mismatch_is_an_explicit_rejection():
    client = ClientHandshake(SECRET, "10.0.0.2:1", suite=Suite.HMAC_SHA256)
    server = ServerHandshake(SECRET, "10.0.0.2")
    ev = feed(server, client.hello())
    assert isinstance(ev, Rejected) and isinstance(ev.error, SuiteMismatch)
    with pytest.raises(SuiteMismatch, match="server requires frame suite aes-256-gcm, this node is configured for hmac-sha256"):
        feed(client, ev.record)


def test_identity_rejection_and_unspecified_ip():
    client = ClientHandshake(SECRET, "10.0.0.9:1")
    server = ServerHandshake(SECRET, "10.0.0.2")
    ev = feed(server, client.hello())
    assert isinstance(ev, Rejected) and isinstance(ev.error, IdentityRejected)
    assert len(ev.record) == 9  # no nonce, no authenticator
    with pytest.raises(IdentityRejected, match="server refused this node's advertised identity 10.0.0.9:1"):
        feed(client, ev.record)
    ev = feed(ServerHandshake(SECRET, "10.0.0.2"), ClientHandshake(SECRET, "0.0.0.0:7").hello())
    assert ev.peer == PeerId("10.0.0.2", 7)


def test_version_rejection_names_both_versions():
    client = ClientHandshake(SECRET, "10.0.0.2:1")
    hello = bytearray(client.hello())
    hello[4:6] = (3).to_bytes(2, "big")
    ev = feed(ServerHandshake(SECRET, "10.0.0.2"), bytes(hello))
    assert isinstance(ev, Rejected)
    assert "client speaks cluster protocol version 3, this node speaks 5" in str(ev.error)
    with pytest.raises(VersionMismatch, match="server speaks cluster protocol version 5"):
        feed(client, ev.record)


def test_at_capacity_verdict_and_forged_verdicts():

    client, server = ClientHandshake(SECRET, "10.0.0.2:1"), ServerHandshake(SECRET, "10.0.0.2")
    with pytest.raises(ServerAtCapacity, match="already holds its maximum number of authenticated connections; retry later"):
        run(client, server, accept=False)
    for accept in (True, False):
        client, server = ClientHandshake(SECRET, "10.0.0.2:1"), ServerHandshake(SECRET, "10.0.0.2")
        feed(server, client.hello())
        feed(client, server.server_hello())
        feed(server, client.client_auth())
        verdict = bytearray(server.verdict(accept))
        verdict[7] ^= 1
        with pytest.raises(VerdictNotVerified, match="server's handshake verdict does not verify under the cluster secret"):
            feed(client, bytes(verdict))
        with pytest.raises(LocalProtocolError):
            _ = client.keys  # no keys derived


def test_malformed_records():
    with pytest.raises(MalformedHandshake, match="bad magic"):
        feed(ServerHandshake(SECRET, "10.0.0.2"), b"XXXX\x00\x05\x01")
    hello = ClientHandshake(SECRET, "not-an-ip:1").hello()
    with pytest.raises(MalformedHandshake, match="not a socket address"):
        feed(ServerHandshake(SECRET, "10.0.0.2"), hello)
    server = ServerHandshake(SECRET, "10.0.0.2")
    with pytest.raises(MalformedHandshake, match="too long"):
        server.receive_data(bytes(1000))


def test_channels_derive_different_keys():
    nonce_c, nonce_s = bytes(32), bytes([1]) * 32
    keys = {}
    for channel in Channel:
        c = ClientHandshake(SECRET, "10.0.0.2:1", channel=channel, nonce=nonce_c)
        s = ServerHandshake(SECRET, "10.0.0.2", channel=channel, nonce=nonce_s)
        keys[channel] = run(c, s)[1].send_key
    assert keys[Channel.TRANSPORT] != keys[Channel.ASSIGNMENT]


def test_identity_helpers():
    assert str(PeerId.parse("[::1]:80")) == "[::1]:80"
    assert PeerId.parse("[::ffff:10.0.0.1]:5") == PeerId("10.0.0.1", 5)
    for bad in ("host:1", "1.2.3.4", "::1:80", "1.2.3.4:99999", "[::1]80"):
        with pytest.raises(ValueError):
            PeerId.parse(bad)
    assert source_key("2001:db8:1:2:3:4:5:6") == source_key("2001:db8:1:2:ffff::1") == "2001:db8:1:2::/64"
    assert source_key("10.0.0.1") != source_key("10.0.0.2")
    with pytest.raises(IdentityRejected):
        bind_identity(PeerId("10.0.0.1", 5), "10.0.0.2")
