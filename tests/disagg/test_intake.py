"""The decode node's handoff intake: parts of one stream in order on its worker, bounded queues."""

from __future__ import annotations

import threading
import time

import pytest

from mlxcel.disagg.intake import DEPTH, Intake, default_workers

WORKERS_ENV = "MLXCEL_HANDOFF_INTAKE_WORKERS"


def test_parts_of_each_stream_run_in_order_off_the_callers_thread():
    intake = Intake(3)
    seen: dict[int, list[int]] = {k: [] for k in range(5)}
    threads: set[str] = set()
    done = threading.Event()
    try:
        for i in range(200):
            key = i % 5
            intake.put(key, lambda k, i: (seen[k].append(i), threads.add(threading.current_thread().name)), key, i)
        intake.put(0, done.set)
        assert done.wait(10)
        time.sleep(0.1)
    finally:
        intake.close()
    assert all(seen[k] == list(range(k, 200, 5)) for k in seen)
    assert threading.current_thread().name not in threads and len(threads) >= 2


def test_a_full_queue_blocks_the_reader_instead_of_buffering():
    intake = Intake(1)
    gate = threading.Event()
    put_all = threading.Event()

    def feed() -> None:
        intake.put("s", gate.wait)  # the worker is busy with this one
        for i in range(DEPTH + 5):
            intake.put("s", lambda: None)
        put_all.set()

    t = threading.Thread(target=feed, daemon=True)
    t.start()
    try:
        assert not put_all.wait(0.5)  # DEPTH queued: the producer waits
        gate.set()
        assert put_all.wait(5)
    finally:
        gate.set()
        intake.close()
        t.join(5)


def test_a_failing_handler_does_not_stop_its_worker_and_zero_workers_run_inline():
    intake = Intake(1)
    ran = threading.Event()
    try:
        intake.put(1, lambda: 1 / 0)
        intake.put(1, ran.set)
        assert ran.wait(5)
    finally:
        intake.close()
    inline = Intake(0)
    where: list[str] = []
    inline.put(1, lambda: where.append(threading.current_thread().name))
    assert where == [threading.current_thread().name]


def test_default_workers(monkeypatch):
    monkeypatch.delenv(WORKERS_ENV, raising=False)
    assert default_workers(2) == 0 and default_workers(4) == 1 and default_workers(16) == 4 and default_workers(64) == 4
    monkeypatch.setenv(WORKERS_ENV, "3")
    assert default_workers(2) == 3


@pytest.mark.parametrize("workers", [0, 2])
def test_decoder_fed_through_the_intake_round_trips(workers):
    import numpy as np

    from mlxcel.disagg.kv_codec import HandoffDecoder, KVLayout, LayerSpec, encode_chunks, encode_header
    from mlxcel.disagg.wire import CacheKind, DType

    layout = KVLayout((LayerSpec(CacheKind.KV, DType.FLOAT32, 2, 8, 8),) * 3)
    tensors = [np.random.default_rng(i).random((1, 2, 9, 8)).astype(np.float32) for i in range(6)]
    dec = HandoffDecoder(layout, 64)
    intake = Intake(workers)
    done = threading.Event()
    try:
        for part in [encode_header({}, tuple(range(9)), layout), *encode_chunks(tensors, 100)]:
            intake.put("k", dec.feed, part)
        intake.put("k", done.set)
        assert done.wait(10)
    finally:
        intake.close()
    assert all(np.array_equal(a, b) for a, b in zip(dec.result().tensors, tensors))
