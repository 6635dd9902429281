"""A real decode process fed by members played by this test on real sockets (docs/disagg.md §4.3, §5).

Each member is a secret holder on its own IP whose handoff documents name its own listener as the
router, so it sees every ERROR, TOKENS and FINISH the decode node answers. The decode node runs with
``--parallel 2 --max-queue 4`` (6 slots, 3 per sender) and ``--handoff-timeout 5``.
"""

from __future__ import annotations

import sys
import time

import numpy as np
import pytest

from mlxcel.cluster.identity import PeerId
from mlxcel.cluster.secret import load_secret
from mlxcel.cluster.transport import Transport
from mlxcel.cluster.wire import Kind
from mlxcel.disagg import messages as m
from mlxcel.disagg.kv_codec import KVLayout, LayerSpec, encode_chunks, encode_header
from mlxcel.disagg.wire import CacheKind, DType, MsgType
from mlxcel.engine.interface import TokenEvent
from mlxcel.engine.sampling import SamplingParams
from mlxcel.error_codes import ErrorCode
from tests.disagg.cluster import FAST, RoleNode, wait_for
from tests.pipeline.cluster import free_port, write_secret

pytestmark = pytest.mark.proc  # starts processes (tests/proc_marker.py)

DECODE_IP, IDLER_IP, HONEST_IP, PROBER_IP = "127.0.0.50", "127.0.0.51", "127.0.0.52", "127.0.0.53"
LAYOUT = KVLayout(tuple(LayerSpec(CacheKind.KV, DType.FLOAT32, 2, 16, 16) for _ in range(4)))  # tiny_llama's
PROMPT = (1, 2, 3)
SLOTS = 6


class Member:
    """A secret holder on ``ip``: sends handoffs naming itself as their router, records control messages."""

    def __init__(self, ip: str, secret):
        self.got: list[tuple[MsgType, dict]] = []
        self.transport = Transport(f"{ip}:0", secret, max_reconnect_attempts=1, reconnect_budget=0)
        self.transport.serve(on_message=lambda msg: self.got.append(m.decode(msg.payload))
                             if msg.kind is Kind.CONTROL else None)

    def doc(self, nonce: str, **changes) -> dict:
        meta = m.HandoffMeta(nonce, self.transport.identity, SamplingParams(max_tokens=2), TokenEvent(5, "")).doc()
        return {**meta, **changes}

    def of(self, kind: MsgType, nonce: str | None = None) -> list[dict]:
        return [d for k, d in list(self.got) if k is kind and (nonce is None or d["nonce"] == nonce)]

    def close(self) -> None:
        self.transport.close()


@pytest.fixture(scope="module")
def decode(tmp_path_factory, tiny_llama):
    yield from decode_node_with_members(tmp_path_factory.mktemp("decode-members"), tiny_llama, DECODE_IP,
                                        (IDLER_IP, HONEST_IP, PROBER_IP))


def decode_node_with_members(tmp, model, decode_ip: str, member_ips: tuple[str, ...]):
    """A real decode node on ``decode_ip`` and a cluster member on each of ``member_ips``, all holding one
    secret: yields (node, its PeerId, {ip: Member}), then stops the node and closes the members."""
    secret_file = write_secret(tmp)
    bind = f"{decode_ip}:{free_port(decode_ip)}"
    node = RoleNode(model, "decode", decode_ip, bind, secret_file, *FAST, "--handoff-timeout", "5")
    members = {ip: Member(ip, load_secret(secret_file)) for ip in member_ips}
    try:
        node.wait_ready()
        yield node, PeerId.parse(bind), members
    finally:
        node.stop()
        for member in members.values():
            member.close()



def full_handoff(member: Member, target: PeerId, nonce: str) -> None:
    with member.transport.open_stream(target) as s:
        s.write(encode_header(member.doc(nonce), PROMPT, LAYOUT))
        for part in encode_chunks([np.zeros(LAYOUT.nbytes(len(PROMPT)), np.uint8)]):
            s.write(part)


def test_a_refused_handoff_with_a_readable_document_is_answered_to_its_router(decode):
    node, target, members = decode
    prober = members[PROBER_IP]
    before = node.state()["refused"]
    cases = {  # nonce -> (document changes, prompt, layout)
        "00000000000000d1": ({"params": {"max_tokens": 0}}, PROMPT, LAYOUT),  # one bad field
        "00000000000000d2": ({"draws": -1}, PROMPT, LAYOUT),
        "00000000000000d3": ({"first": [1, "", None]}, PROMPT, KVLayout(LAYOUT.layers[:3])),  # and 3 layers
    }
    for nonce, (changes, prompt, layout) in cases.items():
        with prober.transport.open_stream(target) as s:
            s.write(encode_header(prober.doc(nonce, **changes), prompt, layout))
    with prober.transport.open_stream(target) as s:  # unreadable: no router to answer
        s.write(encode_header(prober.doc("not-a-nonce", params={"max_tokens": 0}), PROMPT, LAYOUT))
    seen = len(prober.of(MsgType.ERROR))
    errors = {d["nonce"]: d for d in wait_for(lambda: set(cases) <= {d["nonce"] for d in prober.of(MsgType.ERROR)}
                                               and prober.of(MsgType.ERROR)[seen:], what="three ERRORs")}
    assert set(errors) == set(cases)
    for nonce, code, words in (("00000000000000d1", ErrorCode.BAD_REQUEST, "max_tokens"),
                               ("00000000000000d2", ErrorCode.BAD_REQUEST, "draws"),
                               ("00000000000000d3", ErrorCode.BAD_TENSOR, "names 3 layers")):
        assert errors[nonce]["code"] == code and words in errors[nonce]["message"], errors[nonce]
    wait_for(lambda: node.state()["refused"] == before + 4, what="four refusals")
    time.sleep(0.3)
    assert len(prober.of(MsgType.ERROR)) == seen + 3


def test_idle_handoffs_of_one_sender_leave_slots_for_honest_requests(decode):
    node, target, members = decode
    idler, honest = members[IDLER_IP], members[HONEST_IP]
    streams = []
    try:
        for i in range(SLOTS):  # the whole capacity, opened and left idle
            s = idler.transport.open_stream(target)
            s.write(encode_header(idler.doc(f"00000000000000e{i}"), PROMPT, LAYOUT))
            streams.append(s)
        refused = wait_for(lambda: len(idler.of(MsgType.ERROR)) >= SLOTS // 2 and idler.of(MsgType.ERROR),
                           what="the idler's refusals")
        assert {d["code"] for d in refused} == {ErrorCode.OVERLOADED} and "from 127.0.0.51" in refused[0]["message"]
        assert node.state()["incoming"] == SLOTS // 2
        full_handoff(honest, target, "00000000000000f1")
        [finish] = wait_for(lambda: honest.of(MsgType.FINISH, "00000000000000f1"), what="the honest FINISH")
        assert finish["completion_tokens"] == 2 and not honest.of(MsgType.ERROR)
    finally:
        for s in streams:
            s.abort(ErrorCode.CANCELLED, "done")
    wait_for(lambda: node.state()["incoming"] == 0, what="the idle streams to end")


def test_a_stalled_handoff_is_forgotten_after_twice_the_handoff_timeout_with_no_other_traffic(decode):
    node, target, members = decode
    prober = members[PROBER_IP]
    stream = prober.transport.open_stream(target)
    started = time.monotonic()
    stream.write(encode_header(prober.doc("00000000000000a1"), PROMPT, LAYOUT))
    wait_for(lambda: node.state()["incoming"] == 1, what="the stream to arrive")
    time.sleep(8)
    assert node.state()["incoming"] == 1  # still well inside twice --handoff-timeout (10 s)
    wait_for(lambda: node.state()["incoming"] == 0, timeout=8, what="the stalled stream to be forgotten")
    assert 10 <= time.monotonic() - started <= 14
    [error] = wait_for(lambda: prober.of(MsgType.ERROR, "00000000000000a1"), what="the TIMEOUT")
    assert error["code"] == ErrorCode.TIMEOUT and "twice --handoff-timeout" in error["message"]
    stream.abort(ErrorCode.CANCELLED, "done")


def test_decoding_starts_at_the_end_part_and_later_parts_of_the_stream_are_ignored(decode):
    """The decode node admits a handoff once its END part checked every byte, not at STREAM_END; what the
    stream carries after END (a stray chunk, an abort) changes nothing."""
    node, target, members = decode
    honest = members[HONEST_IP]
    before = node.state()
    stream = honest.transport.open_stream(target)
    try:
        stream.write(encode_header(honest.doc("00000000000000b1"), PROMPT, LAYOUT))
        for part in encode_chunks([np.zeros(LAYOUT.nbytes(len(PROMPT)), np.uint8)]):
            stream.write(part)
        [finish] = wait_for(lambda: honest.of(MsgType.FINISH, "00000000000000b1"), what="FINISH before STREAM_END")
        assert finish["completion_tokens"] == 2
        stream.write(b"\x02\x00\x00\x00\x05" + bytes(8))  # a chunk after END
    finally:
        stream.abort(ErrorCode.CANCELLED, "late")
    wait_for(lambda: node.state()["incoming"] == 0, what="the stream to be forgotten")
    after = node.state()
    assert after["handoffs"] == before["handoffs"] + 1 and after["refused"] == before["refused"]
    assert after["aborted"] == before["aborted"] and not honest.of(MsgType.ERROR, "00000000000000b1")


def test_with_intake_workers_and_crypto_helpers_handoffs_finish_and_attacks_are_refused(tmp_path, tiny_llama):
    """The many-core receive path (parts fed to decoders on intake workers, AES on helpers), forced on this
    host: an honest handoff finishes, one whose chunk runs past the layout is refused to its router."""
    secret_file = write_secret(tmp_path)
    ip = "127.0.0.54"
    bind = f"{ip}:{free_port(ip)}"
    env = {"MLXCEL_HANDOFF_INTAKE_WORKERS": "2", "MLXCEL_CRYPTO_WORKERS": "2"}
    node = RoleNode(tiny_llama, "decode", ip, bind, secret_file, *FAST, env=env)
    member = Member(HONEST_IP, load_secret(secret_file))
    target = PeerId.parse(bind)
    try:
        node.wait_ready()
        full_handoff(member, target, "00000000000000c1")
        with member.transport.open_stream(target) as s:
            s.write(encode_header(member.doc("00000000000000c2"), PROMPT, LAYOUT))
            s.write([b"\x02\x00\x00\x00\x00", bytes(LAYOUT.nbytes(len(PROMPT)) + 1)])  # one byte too many
        [finish] = wait_for(lambda: member.of(MsgType.FINISH, "00000000000000c1"), what="the honest FINISH")
        [error] = wait_for(lambda: member.of(MsgType.ERROR, "00000000000000c2"), what="the refusal")
        assert finish["completion_tokens"] == 2
        assert error["code"] == ErrorCode.BAD_TENSOR and "more than the header's" in error["message"]
        wait_for(lambda: node.state()["incoming"] == 0, what="no stream left")
    finally:
        node.stop()
        member.close()


def test_a_cancel_racing_an_arriving_multi_part_handoff_drops_it_cleanly(decode):
    """CANCEL while a long handoff arrives (its client left at its first token): the handoff is dropped and its
    later parts ignored, with no handler traceback in the node's log, no token for it, and every slot back."""
    node, target, members = decode
    prober, honest, router = members[PROBER_IP], members[HONEST_IP], members[IDLER_IP]  # CANCEL: another connection
    prompt = tuple(1 + i % 300 for i in range(2000))  # 2 MB of KV: parts that each take a while beside the CANCEL
    parts = list(encode_chunks([np.zeros(LAYOUT.nbytes(len(prompt)), np.uint8)], chunk_len=256 * 1024))
    before, nonces = node.state(), [f"00000000000001{i:02x}" for i in range(40)]
    for i, nonce in enumerate(nonces):
        with prober.transport.open_stream(target) as s:
            s.write(encode_header(prober.doc(nonce), prompt, LAYOUT))
            for k, part in enumerate(parts[:-1]):  # CANCEL races the chunks in flight ...
                if k == 1 + i % (len(parts) - 3):
                    router.transport.send(target, Kind.CONTROL, m.cancel(nonce))
                s.write(part)
            wait_for(lambda: node.state()["cancelled"] == before["cancelled"] + i + 1, what="the CANCEL")
            s.write(parts[-1])  # ... and lands before END
    wait_for(lambda: node.state()["incoming"] == 0, what="the cancelled streams to end")
    time.sleep(0.5)
    failed = [line for line in node.lines if "handler failed" in line or "Traceback" in line]
    assert not failed, "".join(node.lines[-40:])
    assert not [d for d in prober.of(MsgType.TOKENS) + prober.of(MsgType.FINISH) if d["nonce"] in nonces]
    state = node.state()
    assert state["sequences"] == 0 and state["kv_sequences"] == 0
    assert state["handoffs"] == before["handoffs"] and state["refused"] == before["refused"] + len(nonces)
    for i in range(SLOTS // 2):  # every slot is back: one sender's share of them finishes
        full_handoff(honest, target, f"00000000000002{i:02x}")
    wanted = {f"00000000000002{i:02x}" for i in range(SLOTS // 2)}  # the shared members hold earlier tests' FINISHes
    wait_for(lambda: wanted <= {d["nonce"] for d in honest.of(MsgType.FINISH)}, what="the honest FINISHes")


def test_the_decode_node_keeps_freed_heap_memory_for_its_handoff_buffers(decode):
    """The decode node raised glibc's thresholds at start (mlxcel/disagg/heap.py; docs/disagg.md §4.3)."""
    node, _, _ = decode
    assert node.state()["heap_kept"] is sys.platform.startswith("linux")
