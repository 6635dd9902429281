"""Frame codec: round trips, any single bit flip rejected, byte-at-a-time feeding, caps."""

from __future__ import annotations

import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlxcel.cluster.errors import FrameAuthError, FrameTooLarge, LocalProtocolError, SequenceExhausted, UnknownFrameKind
from mlxcel.cluster.frames import FrameOpener, FrameSealer
from mlxcel.cluster.reader import FrameReader
from mlxcel.cluster.wire import FRAME_HEADER, FRAME_HEADER_LEN, TAG_LEN, Kind, Suite

KEY = bytes(range(32))
OTHER_KEY = bytes(range(1, 33))
PROTECTED = [Suite.AES_256_GCM, Suite.CHACHA20_POLY1305, Suite.HMAC_SHA256]
KINDS = st.sampled_from([int(k) for k in Kind])
PAYLOADS = st.binary(max_size=2048)
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def pair(suite: Suite = Suite.AES_256_GCM, **kw: int) -> tuple[FrameSealer, FrameReader]:
    return FrameSealer(suite, KEY, **kw), FrameReader(FrameOpener(suite, KEY, **kw))


@FAST
@given(suite=st.sampled_from(list(Suite)), frames=st.lists(st.tuples(KINDS, PAYLOADS), min_size=1, max_size=8))
def test_round_trip(suite, frames):
    sealer, reader = pair(suite)
    wire = b"".join(sealer.seal(k, p) for k, p in frames)
    reader.receive_data(wire)
    for kind, payload in frames:
        frame = reader.next_frame()
        assert frame is not None and (frame.kind, frame.payload) == (kind, payload)
    assert reader.next_frame() is None and reader.buffered == 0


@FAST
@given(suite=st.sampled_from(PROTECTED), kind=KINDS, payload=PAYLOADS, data=st.data())
def test_any_single_bit_flip_is_rejected(suite, kind, payload, data):
    sealer = FrameSealer(suite, KEY)
    reader = FrameReader(FrameOpener(suite, KEY, max_frame_len=4096))
    frame = bytearray(sealer.seal(kind, payload))
    bit = data.draw(st.integers(0, len(frame) * 8 - 1))
    frame[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises((FrameAuthError, FrameTooLarge)):
        reader.receive_data(bytes(frame))
        if reader.next_frame() is None:  # a larger len waits for bytes that never authenticate
            reader.receive_data(bytes(8192))
            reader.next_frame()


@FAST
@given(suite=st.sampled_from(list(Suite)), frames=st.lists(st.tuples(KINDS, st.binary(max_size=200)), min_size=1, max_size=4))
def test_byte_at_a_time(suite, frames):
    sealer, reader = pair(suite)
    wire = b"".join(sealer.seal(k, p) for k, p in frames)
    out = []
    for i in range(len(wire)):
        reader.receive_data(wire[i : i + 1])
        frame = reader.next_frame()
        if frame is not None:
            out.append((frame.kind, frame.payload))
            assert i + 1 == sum(FRAME_HEADER_LEN + len(p) + TAG_LEN[suite] for _, p in frames[: len(out)])
    assert out == frames


@pytest.mark.parametrize("suite", PROTECTED)
def test_replay_and_reorder_fail(suite):
    sealer = FrameSealer(suite, KEY)
    a, b = sealer.seal(Kind.CONTROL, b"a"), sealer.seal(Kind.CONTROL, b"b")
    reader = FrameReader(FrameOpener(suite, KEY))
    reader.receive_data(a + a)
    assert reader.next_frame().payload == b"a"
    with pytest.raises(FrameAuthError):
        reader.next_frame()
    reader = FrameReader(FrameOpener(suite, KEY))
    reader.receive_data(b)
    with pytest.raises(FrameAuthError):
        reader.next_frame()


@pytest.mark.parametrize("suite", PROTECTED)
def test_other_connection_key_fails(suite):
    frame = FrameSealer(suite, KEY).seal(Kind.TENSOR_DATA, b"x" * 100)
    reader = FrameReader(FrameOpener(suite, OTHER_KEY))
    reader.receive_data(frame)
    with pytest.raises(FrameAuthError):
        reader.next_frame()


def test_failed_direction_stays_failed():
    opener = FrameOpener(Suite.AES_256_GCM, KEY)
    frame = bytearray(FrameSealer(Suite.AES_256_GCM, KEY).seal(Kind.CONTROL, b"x"))
    frame[-1] ^= 1
    with pytest.raises(FrameAuthError):
        opener.open(frame[:5], frame[5:])
    with pytest.raises(LocalProtocolError):
        opener.parse_header(frame[:5])


def test_aead_payload_is_not_readable_on_the_wire():
    secret_text = b"the prompt the user typed" * 4
    for suite in (Suite.AES_256_GCM, Suite.CHACHA20_POLY1305):
        assert secret_text[:16] not in FrameSealer(suite, KEY).seal(Kind.TENSOR_DATA, secret_text)
    assert secret_text in FrameSealer(Suite.HMAC_SHA256, KEY).seal(Kind.TENSOR_DATA, secret_text)


def test_oversize_len_refused_from_the_header_without_allocating():
    reader = FrameReader(FrameOpener(Suite.AES_256_GCM, KEY))
    tracemalloc.start()
    try:
        with pytest.raises(FrameTooLarge, match="above the cap of 268435456"):
            reader.receive_data(FRAME_HEADER.pack(Kind.TENSOR_DATA, 256 * 1024 * 1024 + 1))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1024 * 1024


def test_len_at_the_cap_is_accepted_from_the_header():
    opener = FrameOpener(Suite.AES_256_GCM, KEY, max_frame_len=100)
    assert opener.parse_header(FRAME_HEADER.pack(Kind.TENSOR_DATA, 100)) == (Kind.TENSOR_DATA, 100)
    with pytest.raises(FrameTooLarge):
        FrameOpener(Suite.AES_256_GCM, KEY, max_frame_len=100).parse_header(FRAME_HEADER.pack(Kind.TENSOR_DATA, 101))
    with pytest.raises(LocalProtocolError):
        FrameSealer(Suite.AES_256_GCM, KEY, max_frame_len=100).seal(Kind.TENSOR_DATA, bytes(101))


def test_unknown_kind_is_refused_after_authentication():
    sealer, reader = pair()
    reader.receive_data(sealer.seal(0x7E, b"?"))
    with pytest.raises(UnknownFrameKind, match="0x7e"):
        reader.next_frame()


def test_sequence_never_wraps():
    sealer = FrameSealer(Suite.AES_256_GCM, KEY, seq_limit=2)
    sealer.seal(Kind.CONTROL, b"0")
    sealer.seal(Kind.CONTROL, b"1")
    with pytest.raises(SequenceExhausted):
        sealer.seal(Kind.CONTROL, b"2")


def test_nonce_is_the_sequence_number():
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    sealer = FrameSealer(Suite.AES_256_GCM, KEY)
    sealer.seal(Kind.CONTROL, b"first")
    frame = sealer.seal(Kind.CONTROL, b"second")
    expected = AESGCM(KEY).encrypt((1).to_bytes(12, "big"), b"second", frame[:5])
    assert frame[5:] == expected
