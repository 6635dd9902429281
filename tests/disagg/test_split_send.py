"""The prefill node's split sender (mlxcel/disagg/split_send.py) over real authenticated sockets: what the
receiver gets decodes to the sent tensors; a lane that dies mid-handoff aborts every other stream of it and
raises, so the prefill node reports the handoff failed and the router fails the request over."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from mlxcel.cluster.errors import ClusterError
from mlxcel.cluster.secret import ClusterSecret
from mlxcel.cluster.transport import Transport
from mlxcel.cluster.wire import Kind
from mlxcel.disagg.kv_codec import HandoffDecoder, KVLayout, LayerSpec, encode_header
from mlxcel.disagg.kv_split import parse_part
from mlxcel.disagg.split_send import send_split
from mlxcel.disagg.wire import CacheKind, DType, Part

LAYOUT = KVLayout((LayerSpec(CacheKind.KV, DType.FLOAT32, heads=4, k_dim=64, v_dim=64),) * 2)
PROMPT = tuple(range(1, 2049))  # 8 MiB of tensor bytes
BIG = KVLayout(LAYOUT.layers * 8)  # 64 MiB: more than the sockets and the outbox hold while the receiver stalls


class Receiver:
    """A transport that records each stream's parts and how it ended."""

    def __init__(self, secret: ClusterSecret, on_data=None):
        self.data: dict[int, list[bytes]] = {}
        self.ends: dict[int, int] = {}
        self.on_data = on_data
        self.transport = Transport("127.0.0.71:0", secret)
        self.transport.serve(on_message=self._message)

    def _message(self, msg) -> None:
        if msg.kind is Kind.STREAM_DATA:
            self.data.setdefault(msg.id, []).append(bytes(msg.payload))
            if self.on_data is not None:
                self.on_data(msg)
        elif msg.kind is Kind.STREAM_END:
            self.ends[msg.id] = msg.status


@pytest.fixture
def pair():
    secret = ClusterSecret(os.urandom(32))
    made = []

    def make(on_data=None):
        rx = Receiver(secret, on_data)
        tx = Transport("127.0.0.70:0", secret, max_reconnect_attempts=0, reconnect_budget=0)
        made.extend([rx.transport, tx])
        return rx, tx

    yield make
    for t in made:
        t.close()


def tensors(layout: KVLayout = LAYOUT) -> list[np.ndarray]:
    rng = np.random.default_rng(5)
    return [rng.standard_normal(t.shape).astype(np.float32) for t in layout.tensors(len(PROMPT))]


def wait(predicate, timeout=20.0) -> None:
    done = threading.Event()
    for _ in range(int(timeout / 0.05)):
        if predicate():
            return
        done.wait(0.05)
    raise AssertionError("timed out")


def test_a_split_send_decodes_to_the_sent_tensors(pair):
    rx, tx = pair()
    sent = tensors()
    header = encode_header({"nonce": "00112233445566aa"}, PROMPT, LAYOUT)
    with ThreadPoolExecutor(3) as workers:
        n = send_split(tx, rx.transport.identity, header, sent, 0, 3, workers, lambda: False)
    wait(lambda: len(rx.ends) == 4)
    assert set(rx.ends.values()) == {0} and n == len(header) + 2 + sum(
        len(p) for sid, parts in rx.data.items() for p in parts if parts[0][0] == Part.PART)
    [head_id] = [sid for sid, parts in rx.data.items() if parts[0][0] == Part.HEADER]
    dec = HandoffDecoder(LAYOUT, 4096)
    for part in rx.data[head_id]:
        dec.feed(part)
    for sid, parts in rx.data.items():
        if sid != head_id:
            stream, index, count = parse_part(memoryview(parts[0]), ValueError)
            assert stream == head_id and count == 3
            dec.start_part(index, count)
            for part in parts[1:]:
                dec.feed_part(index, part)
    assert [t.tobytes() for t in dec.result().tensors] == [t.tobytes() for t in sent]


def test_a_lane_dying_mid_handoff_aborts_every_stream_and_raises(pair):
    gate = threading.Event()

    def on_data(msg) -> None:  # the receiver stalls part 1's lane after its first bytes, until the test acts
        view = memoryview(msg.payload)
        if view[0] == Part.PART and view[-2] == 1:
            gate.wait(10)

    rx, tx = pair(on_data)
    header = encode_header({"nonce": "00112233445566aa"}, PROMPT, BIG)
    lane1 = tx.open_stream(rx.transport.identity, 1).connection  # the lane part 1 travels on
    outcome: dict = {}

    def send() -> None:
        with ThreadPoolExecutor(2) as workers:
            try:
                outcome["sent"] = send_split(tx, rx.transport.identity, header, tensors(BIG), 0, 2, workers,
                                             lambda: False)
            except ClusterError as exc:
                outcome["error"] = exc

    sender = threading.Thread(target=send)
    sender.start()
    wait(lambda: any(p[0][0] == Part.PART and p[0][-2] == 1 for p in list(rx.data.values())))
    lane1.close()  # the lane dies under part 1
    gate.set()
    sender.join(30)
    assert not sender.is_alive() and isinstance(outcome.get("error"), ClusterError), outcome
    [head_id] = [sid for sid, parts in rx.data.items() if parts[0][0] == Part.HEADER]
    wait(lambda: head_id in rx.ends)
    assert rx.ends[head_id] == 1  # aborted: the decode node drops the whole handoff
