"""The test vectors in docs/protocol.md, reproduced by the code and by plain primitives."""

from __future__ import annotations

import hashlib
import hmac
import re
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from mlxcel.cluster.frames import FrameOpener, FrameSealer
from mlxcel.cluster.handshake import ClientHandshake, ClientVerified, Established, ServerHandshake, encode_reject
from mlxcel.cluster.keys import derive_keys
from mlxcel.cluster.secret import ClusterSecret
from mlxcel.cluster.wire import Channel, Kind, RejectReason, Suite

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"


def _vectors() -> dict[str, bytes]:
    block = re.search(r"```test-vectors\n(.*?)```", DOC.read_text(), re.S)
    assert block, "docs/protocol.md has no test-vectors block"
    out = {}
    for line in block.group(1).strip().splitlines():
        name, _, value = line.partition(" = ")
        out[name.strip()] = bytes.fromhex(value.strip())
    return out


V = _vectors()


@pytest.fixture
def secret() -> ClusterSecret:
    return ClusterSecret(V["secret"])


def test_handshake_transcript(secret):
    c = ClientHandshake(secret, "192.0.2.10:19001", nonce=V["client_nonce"])
    s = ServerHandshake(secret, "192.0.2.10", nonce=V["server_nonce"])
    assert c.hello() == V["client_hello"]
    s.receive_data(V["client_hello"])
    s.next_event()
    assert s.server_hello() == V["server_hello"]
    c.receive_data(V["server_hello"])
    c.next_event()
    assert c.client_auth() == V["client_auth"]
    s.receive_data(V["client_auth"])
    assert isinstance(s.next_event(), ClientVerified)
    assert s.verdict(True) == V["verdict_accept"]
    c.receive_data(V["verdict_accept"])
    est = c.next_event()
    assert isinstance(est, Established)
    assert (est.send_key, est.recv_key) == (V["key_transport_c2s"], V["key_transport_s2c"])


def test_at_capacity_verdict_and_reject(secret):
    s = ServerHandshake(secret, "192.0.2.10", nonce=V["server_nonce"])
    s.receive_data(V["client_hello"])
    s.next_event()
    s.server_hello()
    s.receive_data(V["client_auth"])
    s.next_event()
    assert s.verdict(False) == V["verdict_at_capacity"]
    assert encode_reject(RejectReason.IDENTITY) == V["reject_identity"]


def test_authenticators_from_primitives():
    """An independent implementation: only hmac/hashlib and the documented layouts."""
    key = V["secret"]
    ch, sh = V["client_hello"], V["server_hello"]
    assert sh[40:] == hmac.new(key, b"mlxcel-cluster-v5/server-auth\0" + ch + sh[:40], hashlib.sha256).digest()
    assert V["client_auth"][7:] == hmac.new(key, b"mlxcel-cluster-v5/client-auth\0" + ch + sh, hashlib.sha256).digest()
    v = V["verdict_accept"]
    assert v[8:] == hmac.new(key, b"mlxcel-cluster-v5/verdict\0" + ch + sh + V["client_auth"] + v[:8], hashlib.sha256).digest()


def test_keys(secret):
    for channel in Channel:
        keys = derive_keys(secret, V["client_nonce"], V["server_nonce"], channel)
        assert keys.c2s == V[f"key_{channel.label}_c2s"] and keys.s2c == V[f"key_{channel.label}_s2c"]
        for direction in ("c2s", "s2c"):
            info = f"mlxcel-cluster-frame-v1/{channel.label}/{direction}".encode()
            raw = HKDF(hashes.SHA256(), 32, V["client_nonce"] + V["server_nonce"], info).derive(V["secret"])
            assert raw == V[f"key_{channel.label}_{direction}"]


def test_first_frames():
    frame = FrameSealer(Suite.AES_256_GCM, V["key_transport_c2s"]).seal(Kind.TENSOR_DATA, b"hello, stage 1")
    assert frame == V["frame_c2s_0"]
    assert AESGCM(V["key_transport_c2s"]).decrypt(bytes(12), frame[5:], frame[:5]) == b"hello, stage 1"
    assert FrameOpener(Suite.AES_256_GCM, V["key_transport_c2s"]).open(frame[:5], frame[5:]) == b"hello, stage 1"
    assert FrameSealer(Suite.AES_256_GCM, V["key_transport_s2c"]).seal(Kind.CONTROL, b"") == V["frame_s2c_0"]
