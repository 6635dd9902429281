"""A KV handoff split over several part streams (docs/disagg.md §4.9), sans-I/O: the same tensors as one
stream, whatever the interleaving, and every way a part stream can break the split's rules."""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest

from mlxcel.disagg.kv_codec import (HandoffDecoder, HandoffError, KVLayout, LayerSpec, contiguous_runs, encode_chunks,
                                    encode_header)
from mlxcel.disagg.kv_split import encode_part, encode_split, parse_part, range_parts, ranges, total_bytes
from mlxcel.disagg.wire import MAX_KV_CHUNK_LEN, CacheKind, DType
from tests.disagg.test_kv_codec import CONTEXT, LAYOUT, META, PROMPT, tensors_for

HEADER_ID = 7


def one_stream(layout=LAYOUT, prompt=PROMPT, seed=0) -> list[np.ndarray]:
    dec = HandoffDecoder(layout, CONTEXT)
    for part in [encode_header(META, prompt, layout), *encode_chunks(tensors_for(layout, len(prompt), seed), 1000)]:
        dec.feed(part)
    return dec.result().tensors


def split_streams(count: int, chunk_len=300, layout=LAYOUT, prompt=PROMPT, seed=0) -> tuple[list[bytes], list[list[bytes]]]:
    """The header stream's parts and each part stream's (PART record first)."""
    tensors = tensors_for(layout, len(prompt), seed)
    total = total_bytes(tensors)
    head = [encode_header(META, prompt, layout), encode_split(count)]
    lanes = [[encode_part(HEADER_ID, i, count),
              *(b"".join(p) for p in range_parts(runs(tensors), lo, hi, chunk_len))]
             for i, (lo, hi) in enumerate(ranges(total, count))]
    return head, lanes


def runs(tensors):
    return (v for t in tensors for v in contiguous_runs(t))


def feed_lane(dec: HandoffDecoder, lane: list[bytes]) -> None:
    stream, index, count = parse_part(memoryview(lane[0]), HandoffError)
    assert stream == HEADER_ID
    dec.start_part(index, count)
    for part in lane[1:]:
        dec.feed_part(index, part)


def started(count: int, **kw) -> tuple[HandoffDecoder, list[list[bytes]]]:
    head, lanes = split_streams(count, **kw)
    dec = HandoffDecoder(LAYOUT, CONTEXT)
    for part in head:
        dec.feed(part)
    return dec, lanes


@pytest.mark.parametrize("count", [2, 3, 4, 16])
def test_a_split_handoff_imports_the_same_bytes_as_one_stream_whatever_the_interleaving(count):
    want = one_stream()
    dec, lanes = started(count)
    rng = random.Random(count)
    cursors = [0] * count
    for i in range(count):
        dec.start_part(*parse_part(memoryview(lanes[i][0]), HandoffError)[1:])
    live = list(range(count))
    while live:  # parts of different streams interleaved at random; each stream in order
        i = rng.choice(live)
        cursors[i] += 1
        dec.feed_part(i, lanes[i][cursors[i]])
        if cursors[i] == len(lanes[i]) - 1:
            live.remove(i)
    assert dec.state == "done"
    got = dec.result().tensors
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def test_part_streams_fed_from_threads_at_once_give_the_same_bytes():
    layout = KVLayout((LayerSpec(CacheKind.KV, DType.FLOAT32, heads=4, k_dim=64, v_dim=64),) * 3)
    prompt = tuple(range(40))
    want = one_stream(layout, prompt)
    head, lanes = split_streams(4, chunk_len=4096, layout=layout, prompt=prompt)
    dec = HandoffDecoder(layout, CONTEXT)
    for part in head:
        dec.feed(part)
    threads = [threading.Thread(target=feed_lane, args=(dec, lane)) for lane in lanes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert dec.state == "done"
    assert [t.tobytes() for t in dec.result().tensors] == [t.tobytes() for t in want]


def test_the_ranges_cover_every_byte_once():
    assert ranges(10, 3) == [(0, 3), (3, 6), (6, 10)]
    assert ranges(1, 2) == [(0, 0), (0, 1)]  # an empty range: its part stream sends END 0 0


def refused(fn, *args, words: str) -> None:
    with pytest.raises(HandoffError, match=words):
        fn(*args)


def assert_dead(dec: HandoffDecoder) -> None:
    assert dec.state == "error" and dec.held == 0
    with pytest.raises(HandoffError, match="already refused"):
        dec.feed_part(0, b"\x03")


def test_a_duplicate_part_stream_is_refused_and_drops_everything():
    dec, lanes = started(2)
    feed_lane(dec, lanes[0][:3])
    refused(dec.start_part, 0, 2, words="part 0 of this handoff arrived twice")
    assert_dead(dec)


def test_more_parts_than_declared_are_refused():
    dec, lanes = started(2)
    refused(parse_part, memoryview(encode_part(HEADER_ID, 2, 2)), HandoffError, words="part 2 of 2 is outside")
    refused(dec.start_part, 1, 3, words="names a split of 3; the header stream's SPLIT says 2")
    assert_dead(dec)


def test_a_part_stream_carrying_past_its_range_is_refused():
    dec, lanes = started(2)
    feed_lane(dec, lanes[0][:-1])  # every chunk of range 0, no END
    refused(dec.feed_part, 0, b"\x02" + (len(lanes[0]) - 2).to_bytes(4, "big") + b"x",
            words="part 0 carries more than its")
    assert_dead(dec)


@pytest.mark.parametrize("mutate, words", [
    (lambda p: p[:1] + (5).to_bytes(4, "big") + p[5:], "chunk 5 arrived where chunk 0 was due"),
    (lambda p: p[:5], "a chunk of 0 bytes"),
    (lambda p: b"\x01" + p[1:], "not 0x01"),
])
def test_bad_chunks_of_a_part_stream_are_refused(mutate, words):
    dec, lanes = started(2)
    dec.start_part(1, 2)
    refused(dec.feed_part, 1, mutate(lanes[1][1]), words=words)
    assert_dead(dec)


def test_an_end_short_of_its_range_or_a_chunk_after_it_is_refused():
    dec, lanes = started(2)
    dec.start_part(0, 2)
    dec.feed_part(0, lanes[0][1])
    refused(dec.feed_part, 0, lanes[0][-1], words="part 0 ended after 1 chunks")
    dec, lanes = started(2)
    feed_lane(dec, lanes[0])
    refused(dec.feed_part, 0, lanes[0][1], words="after its END")


def test_part_streams_before_split_or_for_an_unsplit_handoff_are_refused():
    dec = HandoffDecoder(LAYOUT, CONTEXT)
    dec.feed(encode_header(META, PROMPT, LAYOUT))
    refused(dec.start_part, 0, 2, words="not split")
    dec = HandoffDecoder(LAYOUT, CONTEXT)
    dec.feed(encode_header(META, PROMPT, LAYOUT))
    refused(dec.feed, b"\x04\x11", words="outside 2..16")
    with pytest.raises(ValueError, match="2..16"):
        encode_split(1)


def test_the_header_stream_carries_no_chunks_after_split_and_a_missing_part_never_completes():
    dec, lanes = started(2)
    with pytest.raises(HandoffError, match="not expected in state split"):
        dec.feed(lanes[0][1])
    dec, lanes = started(2)
    feed_lane(dec, lanes[0])
    assert dec.state == "split"
    refused(dec.result, words="ended before")
    assert dec.held == 0


def test_a_huge_split_claim_allocates_only_what_arrived_allows():
    big = KVLayout((LayerSpec(CacheKind.KV, DType.FLOAT32, heads=1, k_dim=4096, v_dim=4096),))
    prompt = tuple(range(4096))  # 2 tensors of 64 MiB each claimed
    made = []

    def allocate(spec):
        made.append(spec.nbytes)
        return np.empty(spec.shape, np.float32), None

    dec = HandoffDecoder(big, 8192, allocate=allocate)
    dec.feed(encode_header(META, prompt, big))
    dec.feed(encode_split(4))
    for i in range(4):  # the first chunk of every part stream: 4 chunks of 1 MiB arrived
        dec.start_part(i, 4)
        dec.feed_part(i, b"\x02\x00\x00\x00\x00" + bytes(1 << 20))
    assert made == [] and dec.held <= 2 * 4 * (1 << 20) + MAX_KV_CHUNK_LEN
