"""Split handoffs (docs/disagg.md §4.9) sent to a real decode process by members on real sockets: the
same tokens as one stream, and every attack on the part streams refused (docs/disagg.md §4.3, §4.9)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from mlxcel.cluster.identity import PeerId
from mlxcel.cluster.secret import load_secret
from mlxcel.disagg.kv_codec import contiguous_runs, encode_chunks, encode_header
from mlxcel.disagg.kv_split import encode_part, encode_split, range_parts, ranges
from mlxcel.disagg.wire import MAX_KV_EARLY_BYTES, MsgType
from mlxcel.error_codes import ErrorCode
from tests.disagg.cluster import FAST, RoleNode, wait_for
from tests.disagg.test_decode_members import LAYOUT, PROMPT, Member, decode_node_with_members
from tests.pipeline.cluster import free_port, write_secret

pytestmark = pytest.mark.proc  # starts processes (tests/proc_marker.py)

DECODE_IP, HONEST_IP, OTHER_IP = "127.0.0.60", "127.0.0.61", "127.0.0.62"
KV = np.random.default_rng(3).standard_normal(LAYOUT.nbytes(len(PROMPT)) // 4).astype(np.float32)


@pytest.fixture(scope="module")
def decode(tmp_path_factory, tiny_llama):
    yield from decode_node_with_members(tmp_path_factory.mktemp("decode-split"), tiny_llama, DECODE_IP,
                                        (HONEST_IP, OTHER_IP))


def part_streams(count: int, chunk_len: int = 64) -> list[list]:
    """Each part stream's parts after its PART record, for ``KV``."""
    return [list(range_parts(contiguous_runs(KV), lo, hi, chunk_len)) for lo, hi in ranges(KV.nbytes, count)]


def header_stream(member: Member, target: PeerId, nonce: str, count: int):
    s = member.transport.open_stream(target, 0)
    s.write(encode_header(member.doc(nonce), PROMPT, LAYOUT))
    s.write(encode_split(count))
    return s


def send_part(member: Member, target: PeerId, header_id: int, index: int, count: int, parts, lane: int,
              close: bool = True):
    s = member.transport.open_stream(target, lane)
    s.write(encode_part(header_id, index, count))
    for part in parts:
        s.write(part)
    if close:
        s.close()
    return s


def tokens(member: Member, nonce: str) -> list[int]:
    wait_for(lambda: member.of(MsgType.FINISH, nonce) or member.of(MsgType.ERROR, nonce), what=f"{nonce}'s end")
    assert not member.of(MsgType.ERROR, nonce), member.of(MsgType.ERROR, nonce)
    return [e[0] for d in member.of(MsgType.TOKENS, nonce) for e in d["events"]]


@pytest.mark.parametrize("count", [2, 4])
def test_a_split_handoff_decodes_the_same_tokens_as_one_stream(decode, count):
    node, target, members = decode
    honest = members[HONEST_IP]
    one, split = f"00000000000001a{count}", f"00000000000001b{count}"
    with honest.transport.open_stream(target) as s:
        s.write(encode_header(honest.doc(one), PROMPT, LAYOUT))
        for part in encode_chunks([KV]):
            s.write(part)
    head = header_stream(honest, target, split, count)
    for i, parts in enumerate(part_streams(count)):  # each part stream on its own lane (connection)
        send_part(honest, target, head.id, i, count, parts, lane=i)
    head.close()
    assert tokens(honest, split) == tokens(honest, one) and len(tokens(honest, one)) >= 2
    wait_for(lambda: node.state()["incoming"] == 0, what="no stream left")


def test_a_part_stream_from_another_identity_never_joins(decode):
    node, target, members = decode
    honest, other = members[HONEST_IP], members[OTHER_IP]
    nonce = "00000000000002a1"
    parts = part_streams(2)
    head = header_stream(honest, target, nonce, 2)
    send_part(honest, target, head.id, 0, 2, parts[0], lane=0)
    send_part(other, target, head.id, 1, 2, parts[1], lane=0)  # the missing part, by another member
    time.sleep(1.0)
    assert not honest.of(MsgType.FINISH, nonce) and not honest.of(MsgType.TOKENS, nonce)
    send_part(honest, target, head.id, 1, 2, parts[1], lane=1)  # the sender's own completes it
    head.close()
    assert len(tokens(honest, nonce)) >= 2


@pytest.mark.parametrize("nonce, attack, words", [
    ("00000000000003a1", "duplicate", "part 0 of this handoff arrived twice"),
    ("00000000000003a2", "count", "names a split of 3; the header stream's SPLIT says 2"),
    ("00000000000003a3", "overrun", "part 0 carries more than its"),
    ("00000000000003a4", "truncated", "part 1 ended before its END record"),
    ("00000000000003a5", "extra", "part 2 of 2 is outside a split of 2..16 part streams"),
])
def test_bad_part_streams_refuse_the_handoff_to_its_router(decode, nonce, attack, words):
    node, target, members = decode
    honest = members[HONEST_IP]
    before = node.state()["refused"]
    parts = part_streams(2)
    head = header_stream(honest, target, nonce, 2)
    time.sleep(0.2)  # the header stream is read first: these part streams join at once
    if attack == "duplicate":
        first = send_part(honest, target, head.id, 0, 2, parts[0][:1], lane=0, close=False)
        send_part(honest, target, head.id, 0, 2, parts[0][:1], lane=1, close=False)
    elif attack == "count":
        send_part(honest, target, head.id, 1, 3, parts[1], lane=1)
    elif attack == "extra":  # one part stream more than the SPLIT declared
        send_part(honest, target, head.id, 2, 2, parts[1], lane=1)
    elif attack == "overrun":
        send_part(honest, target, head.id, 0, 2, [*parts[0][:-1], (b"\x02" + (len(parts[0]) - 1).to_bytes(4, "big"),
                                                                    b"x")], lane=0)
    else:
        send_part(honest, target, head.id, 1, 2, parts[1][:-1], lane=1)  # no END, then STREAM_END
    [error] = wait_for(lambda: honest.of(MsgType.ERROR, nonce), what="the refusal")
    code = ErrorCode.BAD_TENSOR if attack == "overrun" else ErrorCode.BAD_REQUEST  # a bound, as one stream's
    assert error["code"] == code and words in error["message"], error
    if attack == "duplicate":
        first.abort(ErrorCode.CANCELLED, "done")
    head.close()
    wait_for(lambda: node.state()["refused"] == before + 1, what="one refusal")
    wait_for(lambda: node.state()["incoming"] == 0, what="no stream left")
    assert not honest.of(MsgType.FINISH, nonce)


def test_part_streams_before_their_header_are_bounded_and_refuse_it(decode):
    """Parts kept before their header stream is read stop at MAX_KV_EARLY_BYTES: they are dropped, and the
    handoff is refused to its router when its header comes."""
    node, target, members = decode
    honest = members[HONEST_IP]
    nonce = "00000000000004a1"
    head = honest.transport.open_stream(target, 0)  # its id, before anything is sent on it
    flood = [(b"\x02" + i.to_bytes(4, "big"), bytes(1 << 20)) for i in range(MAX_KV_EARLY_BYTES // (1 << 20) + 2)]
    early = send_part(honest, target, head.id, 0, 2, flood, lane=1, close=False)
    wait_for(lambda: node.state()["early_part_streams"] == 1, what="the early part stream")
    time.sleep(0.5)
    assert node.state()["early_part_bytes"] <= MAX_KV_EARLY_BYTES
    head.write(encode_header(honest.doc(nonce), PROMPT, LAYOUT))
    head.write(encode_split(2))
    [error] = wait_for(lambda: honest.of(MsgType.ERROR, nonce), what="the refusal")
    assert error["code"] == ErrorCode.BAD_REQUEST and f"more than {MAX_KV_EARLY_BYTES} bytes" in error["message"]
    early.abort(ErrorCode.CANCELLED, "done")
    head.close()
    wait_for(lambda: node.state()["early_part_streams"] == 0, what="nothing early left")


def test_more_part_streams_than_a_split_can_have_refuse_the_handoff(decode):
    node, target, members = decode
    honest = members[HONEST_IP]
    nonce = "00000000000004b1"
    head = honest.transport.open_stream(target, 0)
    for i in range(17):  # PART records alone, before the header stream: at most 16 wait
        send_part(honest, target, head.id, i % 2, 2, [], lane=i % 2, close=False)
    wait_for(lambda: node.state()["early_part_streams"] == 17, what="the early part streams")
    head.write(encode_header(honest.doc(nonce), PROMPT, LAYOUT))
    head.write(encode_split(2))
    [error] = wait_for(lambda: honest.of(MsgType.ERROR, nonce), what="the refusal")
    assert error["code"] == ErrorCode.BAD_REQUEST and "more than 16 part streams" in error["message"], error
    head.close()
    wait_for(lambda: node.state()["early_part_streams"] == 0, what="nothing early left")


def test_part_streams_whose_header_never_comes_are_forgotten(decode):
    node, target, members = decode
    honest = members[HONEST_IP]
    head = honest.transport.open_stream(target, 0)  # never used: no header comes
    early = send_part(honest, target, head.id, 1, 2, part_streams(2)[1][:1], lane=1, close=False)
    wait_for(lambda: node.state()["early_part_bytes"] > 0, what="the early part")
    wait_for(lambda: node.state()["early_part_streams"] == 0, timeout=20, what="twice --handoff-timeout (10 s)")
    assert node.state()["early_part_bytes"] == 0 and node.state()["incoming"] == 0
    early.abort(ErrorCode.CANCELLED, "done")


def test_a_lane_dying_mid_handoff_drops_the_whole_handoff(decode):
    """An aborted part stream (its lane failed at the sender, which aborts the header stream too) drops every
    byte of the handoff; its router hears of it from the prefill node, which fails the request over."""
    node, target, members = decode
    honest = members[HONEST_IP]
    nonce = "00000000000005a1"
    before = node.state()
    parts = part_streams(2)
    head = header_stream(honest, target, nonce, 2)
    send_part(honest, target, head.id, 0, 2, parts[0], lane=0)
    dying = send_part(honest, target, head.id, 1, 2, parts[1][:2], lane=1, close=False)
    wait_for(lambda: node.state()["incoming_bytes"] > 0, what="bytes arriving")
    dying.abort(ErrorCode.UNREACHABLE, "the lane died")
    head.abort(ErrorCode.UNREACHABLE, "a part stream of the handoff failed")
    wait_for(lambda: node.state()["incoming"] == 0, what="the handoff to be dropped")
    after = node.state()
    assert after["aborted"] > before["aborted"] and after["handoffs"] == before["handoffs"]
    time.sleep(0.3)
    assert not honest.of(MsgType.FINISH, nonce) and not honest.of(MsgType.ERROR, nonce)


def test_with_intake_workers_a_split_handoff_decodes_the_same_tokens(tmp_path, tiny_llama):
    """Part streams fed on intake workers (each stream on its worker, several at once) and AES on helpers."""
    secret_file = write_secret(tmp_path)
    ip = "127.0.0.63"
    bind = f"{ip}:{free_port(ip)}"
    node = RoleNode(tiny_llama, "decode", ip, bind, secret_file, *FAST,
                    env={"MLXCEL_HANDOFF_INTAKE_WORKERS": "3", "MLXCEL_CRYPTO_WORKERS": "2"})
    member = Member(HONEST_IP, load_secret(secret_file))
    target = PeerId.parse(bind)
    try:
        node.wait_ready()
        with member.transport.open_stream(target) as s:
            s.write(encode_header(member.doc("00000000000006a1"), PROMPT, LAYOUT))
            for part in encode_chunks([KV]):
                s.write(part)
        head = header_stream(member, target, "00000000000006a2", 4)
        for i, parts in enumerate(part_streams(4, chunk_len=16)):
            send_part(member, target, head.id, i, 4, parts, lane=i)
        head.close()
        assert tokens(member, "00000000000006a2") == tokens(member, "00000000000006a1")
        wait_for(lambda: node.state()["incoming"] == 0, what="no stream left")
    finally:
        node.stop()
        member.close()
