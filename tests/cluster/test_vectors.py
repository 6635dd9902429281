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

from mlxcel.cluster.errors import FrameAuthError, MessageError
from mlxcel.cluster.frames import FrameOpener, FrameSealer
from mlxcel.cluster.handshake import ClientHandshake, ClientVerified, Established, ServerHandshake, encode_reject
from mlxcel.cluster.identity import PeerId
from mlxcel.cluster.keys import derive_keys
from mlxcel.cluster.messages import Assembler
from mlxcel.cluster.aead_pipeline import CryptoPool, OpenPipeline
from mlxcel.cluster.reader import FrameReader
from mlxcel.cluster.secret import ClusterSecret
from mlxcel.cluster.wire import MESSAGE_BEGIN, STREAM_DATA, Channel, Kind, RejectReason, Suite

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


# --- the fragmented message (frame_c2s_1..3) ----------------------------------------------------

FRAGMENTS = ["frame_c2s_1", "frame_c2s_2", "frame_c2s_3"]


def test_fragmented_message_from_primitives():
    """An independent reading: the documented header, nonce and payload layouts."""
    aead = AESGCM(V["key_transport_c2s"])
    payloads = [aead.decrypt(seq.to_bytes(12, "big"), V[name][5:], V[name][:5]) for seq, name in enumerate(FRAGMENTS, 1)]
    assert [V[name][:5].hex() for name in FRAGMENTS] == ["1000000011", "1100000018", "1100000010"]
    begin = payloads[0]
    assert begin[0] == 0x05 and int.from_bytes(begin[1:9], "big") == 40 and int.from_bytes(begin[9:17], "big") == 7
    assert payloads[1] + payloads[2] == V["stream_body"] == b"KV layer 0: keys and values, 40 bytes..."


def test_fragmented_message_is_sealed_by_the_code():
    sealer = FrameSealer(Suite.AES_256_GCM, V["key_transport_c2s"])
    assert sealer.seal(Kind.TENSOR_DATA, b"hello, stage 1") == V["frame_c2s_0"]
    body = V["stream_body"]
    parts = [
        (Kind.MESSAGE_BEGIN, MESSAGE_BEGIN.pack(Kind.STREAM_DATA, 40) + STREAM_DATA.pack(7)),
        (Kind.MESSAGE_CONTINUE, body[:24]),
        (Kind.MESSAGE_CONTINUE, body[24:]),
    ]
    assert [sealer.seal(k, p) for k, p in parts] == [V[name] for name in FRAGMENTS]


def _read(wire: bytes, workers: int | None) -> list:
    opener = FrameOpener(Suite.AES_256_GCM, V["key_transport_c2s"])
    asm = Assembler(PeerId("192.0.2.10", 19001))
    pool = CryptoPool(workers) if workers is not None else None
    pipe = OpenPipeline(opener, pool, 64, min_len=1) if pool is not None else None
    reader = FrameReader(opener, destination=asm.destination, capacity=128, pipeline=pipe)
    reader.receive_data(wire)
    got = []
    try:
        while (frame := reader.next_frame()) is not None:  # drains: each frame authenticated
            msg = asm.frame_done(frame.kind, len(frame.payload))
            if msg is not None:
                got.append((msg.kind, msg.id, bytes(msg.payload)))
    finally:
        if pool is not None:
            pool.close()
    assert pipe is None or pipe._next == 2  # both MESSAGE_CONTINUE frames went through the pipeline
    return got


@pytest.mark.parametrize("workers", [None, 0, 2], ids=["serial", "pipeline-inline", "pipeline-helpers"])
def test_fragmented_message_is_read_by_the_code(workers):
    wire = V["frame_c2s_0"] + b"".join(V[name] for name in FRAGMENTS)
    assert _read(wire, workers) == [(Kind.TENSOR_DATA, 0, b"hello, stage 1"), (Kind.STREAM_DATA, 7, V["stream_body"])]


@pytest.mark.parametrize("workers", [None, 2], ids=["serial", "pipeline-helpers"])
@pytest.mark.parametrize("change", ["swap", "repeat", "alter-begin", "alter-chunk", "alter-tag"])
def test_fragmented_message_changed_in_any_way_fails(workers, change):
    f1, f2, f3 = (V[name] for name in FRAGMENTS)
    flip = lambda b, i: b[:i] + bytes([b[i] ^ 1]) + b[i + 1 :]  # noqa: E731
    frames = {
        "swap": [f1, f3, f2],
        "repeat": [f1, f2, f2],
        "alter-begin": [flip(f1, 7), f2, f3],
        "alter-chunk": [f1, flip(f2, 9), f3],
        "alter-tag": [f1, f2, flip(f3, len(f3) - 1)],
    }[change]
    with pytest.raises((FrameAuthError, MessageError)):
        _read(V["frame_c2s_0"] + b"".join(frames), workers)
