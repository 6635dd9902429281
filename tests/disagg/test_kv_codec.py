"""The KV handoff codec on its own (no MLX): round trips and every way a handoff can break its bounds."""

from __future__ import annotations

import random
import struct
import tracemalloc

import numpy as np
import pytest

from mlxcel.disagg.kv_codec import (
    ARRAY_RECORD,
    LAYER_RECORD,
    HandoffDecoder,
    HandoffError,
    KVLayout,
    LayerSpec,
    TensorSpec,
    chunk_parts,
    contiguous_runs,
    encode_chunks,
    encode_header,
)
from mlxcel.disagg.wire import MAX_KV_ARRAYS, MAX_KV_CHUNK_LEN, MAX_KV_META_LEN, CacheKind, DType, Part
from mlxcel.error_codes import ErrorCode

KV = LayerSpec(CacheKind.KV, DType.FLOAT32, heads=2, k_dim=8, v_dim=8)
SLIDING = LayerSpec(CacheKind.ROTATING, DType.FLOAT32, heads=2, k_dim=8, v_dim=8, max_size=4, keep=0)
QUANT = LayerSpec(CacheKind.QUANTIZED, DType.BFLOAT16, heads=2, k_dim=64, v_dim=64, group_size=32, bits=4)
LAYOUT = KVLayout((KV, SLIDING, QUANT))
PROMPT = tuple(range(100, 107))  # 7 tokens: the sliding layer keeps 4
META = {"nonce": "00112233445566aa", "first": {"token": 5}}
CONTEXT = 64


def tensors_for(layout: KVLayout, length: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for spec in layout.tensors(length):
        dtype = {DType.FLOAT32: np.float32, DType.BFLOAT16: np.uint16, DType.UINT32: np.uint32,
                 DType.FLOAT16: np.float16}[spec.dtype]
        out.append((rng.random(spec.shape) * 1000).astype(dtype))
    return out


def parts(layout=LAYOUT, prompt=PROMPT, chunk_len=1000, seed=0) -> list[bytes]:
    return [encode_header(META, prompt, layout), *encode_chunks(tensors_for(layout, len(prompt), seed), chunk_len)]


def decoder(layout=LAYOUT, context=CONTEXT) -> HandoffDecoder:
    return HandoffDecoder(layout, context)


def refused(dec: HandoffDecoder, part: bytes, *words: str) -> HandoffError:
    with pytest.raises(HandoffError) as info:
        dec.feed(part)
    for word in words:
        assert word in str(info.value)
    assert dec.state == "error" and dec.held == 0 and dec._done == []  # nothing kept
    with pytest.raises(HandoffError):
        dec.feed(part)  # a refused handoff stays refused
    return info.value


# -- round trips ------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_len", [1, 7, 1000, MAX_KV_CHUNK_LEN])
def test_every_layer_kind_round_trips_whatever_the_chunking(chunk_len):
    sent = tensors_for(LAYOUT, len(PROMPT))
    dec = decoder()
    for part in parts(chunk_len=chunk_len):
        dec.feed(part)
    got = dec.result()
    assert got.meta == META and got.prompt == PROMPT
    assert [t.shape for t in got.tensors] == [t.shape for t in sent]
    assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(got.tensors, sent))
    assert [t.shape for t in got.tensors][2] == (1, 2, 4, 8)  # the sliding layer: its window only
    assert got.nbytes == LAYOUT.nbytes(len(PROMPT)) == dec.expected


def test_the_header_layout_is_the_documented_one():
    header = encode_header({"a": 1}, (7, 8), KVLayout((KV,)))
    meta = b'{"a":1}'
    assert header[:10] == bytes([Part.HEADER]) + b"MXKV" + bytes([1]) + struct.pack(">I", len(meta))
    assert header[10:10 + len(meta)] == meta
    rest = header[10 + len(meta):]
    assert rest[:4] == struct.pack(">I", 2) and rest[4:12] == struct.pack("<II", 7, 8)
    assert rest[12:14] == struct.pack(">H", 1)
    assert rest[14:] == LAYER_RECORD.pack(CacheKind.KV, DType.FLOAT32, 2, 8, 8, 2, 2, 0, 0)
    assert len(rest[14:]) == 24


def test_chunks_cut_tensors_anywhere_and_end_with_the_totals():
    chunks = list(encode_chunks([np.arange(5, dtype=np.float32), np.arange(3, dtype=np.uint32)], chunk_len=8))
    assert [len(c) for c in chunks[:-1]] == [5 + 8, 5 + 8, 5 + 8, 5 + 8]  # 32 bytes in 8-byte chunks
    assert chunks[-1] == struct.pack(">BIQ", Part.END, 4, 32)


def test_chunk_parts_are_views_of_strided_tensors_with_the_joined_parts_bytes():
    """The sender's parts: a cache buffer cut to its positions travels as one view per head, no copy."""
    buffer = np.arange(3 * 16 * 4, dtype=np.uint16).reshape(1, 3, 16, 4)  # capacity 16 positions
    cut = buffer[:, :, :5, :]  # 5 positions held: not C-contiguous
    runs = list(contiguous_runs(cut))
    assert len(runs) == 3 and all(np.shares_memory(np.frombuffer(r, np.uint8), buffer) for r in runs)
    assert b"".join(runs) == np.ascontiguousarray(cut).tobytes()
    tensors = [cut, np.arange(7, dtype=np.float32)]
    for chunk_len in (1, 9, 40, 1000):
        gathered = list(chunk_parts(tensors, chunk_len))
        joined = list(encode_chunks([np.ascontiguousarray(t) for t in tensors], chunk_len))
        assert [b"".join(bytes(p) for p in g) for g in gathered] == joined
        assert all(isinstance(g[0], bytes) and len(g[0]) in (5, 13) for g in gathered)


# -- attacks: the header ----------------------------------------------------------------------------


def test_a_handoff_for_another_layer_count_is_refused():
    other = KVLayout((KV, SLIDING))
    refused(decoder(), encode_header(META, PROMPT, other), "names 2 layers; this model has 3")


@pytest.mark.parametrize("spec, words", [
    (LayerSpec(CacheKind.KV, DType.FLOAT16, 2, 8, 8), "float16"),  # wrong dtype
    (LayerSpec(CacheKind.KV, DType.FLOAT32, 3, 8, 8), "3 heads"),  # wrong shape: heads
    (LayerSpec(CacheKind.KV, DType.FLOAT32, 2, 16, 8), "k 16"),  # wrong shape: key width
    (LayerSpec(CacheKind.ROTATING, DType.FLOAT32, 2, 8, 8, max_size=4), "rotating"),  # wrong kind
])
def test_a_layer_record_that_differs_from_the_model_is_refused(spec, words):
    theirs = KVLayout((spec, SLIDING, QUANT))
    err = refused(decoder(), encode_header(META, PROMPT, theirs), "layer 0", words)
    assert err.code is ErrorCode.BAD_TENSOR


def test_a_sliding_layer_claiming_more_positions_than_its_window_is_refused():
    header = bytearray(encode_header(META, PROMPT, LAYOUT))
    start = len(header) - 2 * LAYER_RECORD.size  # the sliding layer's record
    record = list(LAYER_RECORD.unpack_from(header, start))
    record[5] = 7  # positions: the whole prompt instead of its 4-position window
    header[start:start + LAYER_RECORD.size] = LAYER_RECORD.pack(*record)
    refused(decoder(), bytes(header), "layer 1", "7 positions")


def test_a_record_whose_tokens_differ_from_the_prompt_is_refused():
    header = bytearray(encode_header(META, PROMPT, LAYOUT))
    start = len(header) - 3 * LAYER_RECORD.size
    record = list(LAYER_RECORD.unpack_from(header, start))
    record[5] = record[6] = 2**31  # a huge length in the record only
    header[start:start + LAYER_RECORD.size] = LAYER_RECORD.pack(*record)
    refused(decoder(), bytes(header), "layer 0")


def test_a_prompt_longer_than_the_context_is_refused():
    refused(decoder(context=6), encode_header(META, PROMPT, LAYOUT), "7 prompt tokens", "1..6")


def test_an_empty_prompt_is_refused():
    refused(decoder(), encode_header(META, (), LAYOUT), "0 prompt tokens")


def test_an_oversize_request_document_claim_is_refused_before_reading_it():
    header = struct.pack(">B4sBI", Part.HEADER, b"MXKV", 1, 2**32 - 1)
    err = refused(decoder(), header, f"more than {MAX_KV_META_LEN}")
    assert err.code is ErrorCode.BAD_REQUEST
    with pytest.raises(HandoffError, match="more than"):
        encode_header({"x": "y" * MAX_KV_META_LEN}, PROMPT, LAYOUT)


def test_a_header_claiming_a_huge_cache_allocates_nothing_before_its_bytes_arrive():
    big = KVLayout((LayerSpec(CacheKind.KV, DType.FLOAT32, heads=8, k_dim=128, v_dim=128),))
    prompt = tuple(range(100_000))
    header = encode_header(META, prompt, big)
    dec = decoder(big, context=100_000)
    tracemalloc.start()
    try:
        dec.feed(header)
        dec.feed(next(encode_chunks([np.zeros(1000, np.uint8)], 1000)))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert dec.expected == 2 * 8 * 128 * 4 * 100_000  # 819 MB claimed
    assert peak < 8 * 1024 * 1024  # the prompt's ids and one chunk, not the claim
    assert dec.held == 1000


@pytest.mark.parametrize("mutate, words", [
    (lambda h: h[:1] + b"XXXX" + h[5:], "not a version-1"),
    (lambda h: h[:5] + b"\x02" + h[6:], "version 2"),
    (lambda h: h[:10] + b"{" * 10 + h[20:], "not JSON"),
    (lambda h: h + b"\x00", "layer records make it"),
    (lambda h: b"", "empty"),
])
def test_malformed_headers_are_refused(mutate, words):
    refused(decoder(), mutate(encode_header({"abcdefghij": 1}, PROMPT, LAYOUT)), words)


def test_a_json_array_as_the_request_document_is_refused():
    refused(decoder(), encode_header([1, 2], PROMPT, LAYOUT), "not a JSON object")  # type: ignore[arg-type]


def test_every_cut_of_a_header_is_a_clean_refusal():
    header = encode_header(META, PROMPT, LAYOUT)
    for n in range(1, len(header)):
        with pytest.raises(HandoffError):
            decoder().feed(header[:n])


def test_random_corruption_of_a_header_never_escapes_as_another_error():
    header = encode_header(META, PROMPT, LAYOUT)
    rng = random.Random(16)
    for _ in range(2000):
        bad = bytearray(header)
        for _ in range(rng.randint(1, 4)):
            bad[rng.randrange(len(bad))] = rng.randrange(256)
        dec = decoder()
        try:
            dec.feed(bytes(bad))
        except HandoffError:
            continue
        assert dec.state == "chunks" and dec.expected <= LAYOUT.nbytes(CONTEXT)  # accepted only within bounds


# -- attacks: chunks and the end --------------------------------------------------------------------


def test_chunks_beyond_the_header_are_refused_without_keeping_them():
    ps = parts()
    dec = decoder()
    for p in ps[:-1]:
        dec.feed(p)
    extra = struct.pack(">BI", Part.CHUNK, len(ps) - 2) + b"\x00" * 16
    refused(dec, extra, "more than the header's")


def test_an_oversize_chunk_is_refused():
    dec = decoder()
    dec.feed(parts()[0])
    refused(dec, struct.pack(">BI", Part.CHUNK, 0) + bytes(MAX_KV_CHUNK_LEN + 1), "outside 1..")


def test_chunks_out_of_order_or_empty_are_refused():
    ps = parts()
    dec = decoder()
    dec.feed(ps[0])
    refused(dec, ps[2], "chunk 1 arrived where chunk 0 was due")
    dec = decoder()
    dec.feed(ps[0])
    refused(dec, struct.pack(">BI", Part.CHUNK, 0), "a chunk of 0 bytes")


def test_a_truncated_stream_is_refused_at_its_end():
    ps = parts()
    dec = decoder()
    for p in ps[:-2]:  # the last chunk and the END record never arrive
        dec.feed(p)
    with pytest.raises(HandoffError, match="ended before its END record"):
        dec.result()
    assert dec.state == "error" and dec._done == []


def test_an_end_record_that_disagrees_with_the_chunks_is_refused():
    ps = parts()
    dec = decoder()
    for p in ps[:-2]:
        dec.feed(p)
    refused(dec, ps[-1], "END says")  # the totals of the whole stream, one chunk missing


def test_parts_out_of_place_are_refused():
    ps = parts()
    refused(decoder(), ps[1], "not expected in state header")
    dec = decoder()
    dec.feed(ps[0])
    refused(dec, ps[0], "not expected in state chunks")
    dec = decoder()
    for p in ps:
        dec.feed(p)
    refused(dec, ps[1], "not expected in state done")
    refused(decoder(), bytes([0x7F]) + ps[0][1:], "part 0x7f")


def test_an_unsupported_layout_cannot_receive():
    with pytest.raises(ValueError, match="cannot"):
        HandoffDecoder(KVLayout(unsupported="cannot be handed off"), CONTEXT)


# -- the receive path: preallocated tensor buffers ----------------------------------------------------


class Counting:
    """An allocator that records every buffer it makes (size and the decoder's received bytes then)."""

    def __init__(self, dec_ref=None):
        self.made: list[int] = []
        self.dec: HandoffDecoder | None = None

    def __call__(self, spec: TensorSpec):
        assert self.dec is not None and spec.nbytes <= self.dec.received + MAX_KV_CHUNK_LEN
        self.made.append(spec.nbytes)
        arr = np.full(spec.shape, 0xAB, dtype={DType.FLOAT32: np.float32, DType.BFLOAT16: np.uint16,
                                                DType.UINT32: np.uint32, DType.FLOAT16: np.float16}[spec.dtype])
        return arr, ("owner", len(self.made))


def counting_decoder(layout=LAYOUT, context=CONTEXT) -> tuple[HandoffDecoder, Counting]:
    alloc = Counting()
    dec = HandoffDecoder(layout, context, None, alloc)
    alloc.dec = dec
    return dec, alloc


@pytest.mark.parametrize("chunk_len", [1, 7, 1000])
def test_chunks_land_in_preallocated_buffers_one_per_tensor(chunk_len):
    sent = tensors_for(MIXED, len(PROMPT))
    dec, alloc = counting_decoder(MIXED)
    for part in parts(MIXED, chunk_len=chunk_len):
        dec.feed(part)
    got = dec.result()
    assert all(np.array_equal(a, b) for a, b in zip(got.tensors, sent))
    assert alloc.made == [t.nbytes for t in MIXED.tensors(len(PROMPT)) if t.nbytes]  # one buffer each, no more
    assert [o for o in got.owners if o is not None] == [("owner", i + 1) for i in range(len(alloc.made))]


def test_a_huge_claim_preallocates_only_what_the_arrived_bytes_allow():
    """Tensors of 64 MiB (a 16k-token claim): no buffer until the stream carried 60 MiB, and at every part
    the decoder holds at most twice what arrived plus 4 MiB."""
    big = KVLayout((LayerSpec(CacheKind.KV, DType.FLOAT32, heads=8, k_dim=128, v_dim=128),) * 2)
    prompt = tuple(range(16384))
    dec, alloc = counting_decoder(big, context=16384)
    dec.feed(encode_header(META, prompt, big))
    assert dec.held == 0 and alloc.made == []
    size = 8 * 128 * 4 * 16384  # 64 MiB per tensor
    tensors = [np.zeros(size // 4, np.float32), np.zeros(size // 4, np.float32)]
    for k, part in enumerate(encode_chunks(tensors, MAX_KV_CHUNK_LEN)):
        dec.feed(part)
        assert dec.held <= 2 * dec.received + MAX_KV_CHUNK_LEN
        if dec.received + MAX_KV_CHUNK_LEN < size:
            assert alloc.made == [], k  # the first tensor keeps its chunks as received until then
        if dec.received >= 3 * size // 2:
            break
    assert alloc.made == [size, size]
    dec.feed(struct.pack(">BI", Part.CHUNK, dec._chunks) + b"\x01")
    assert dec.state == "chunks"


def test_the_claim_of_a_header_alone_allocates_nothing():
    big = KVLayout((LayerSpec(CacheKind.KV, DType.FLOAT32, heads=8, k_dim=128, v_dim=128),))
    dec, alloc = counting_decoder(big, context=100_000)
    dec.feed(encode_header(META, tuple(range(100_000)), big))
    dec.feed(next(encode_chunks([np.zeros(1000, np.uint8)], 1000)))
    assert alloc.made == [] and dec.held == 1000 and dec.allocated == 0


def test_a_chunk_spanning_tensors_fills_each_buffer_and_one_past_the_end_is_refused():
    ps = parts(chunk_len=MAX_KV_CHUNK_LEN)  # one chunk carries every tensor
    assert len(ps) == 3
    dec, alloc = counting_decoder()
    dec.feed(ps[0])
    dec.feed(ps[1])
    assert len(alloc.made) == len(LAYOUT.tensors(len(PROMPT)))
    refused(dec, struct.pack(">BI", Part.CHUNK, 1) + b"\x00", "more than the header's")
    dec, alloc = counting_decoder()
    dec.feed(ps[0])
    refused(dec, ps[1][:5] + bytes(ps[1][5:]) + b"\x00", "more than the header's")  # one byte beyond the last tensor
    assert dec.allocated == 0


@pytest.mark.parametrize("attack", ["truncated", "reordered", "duplicate", "end-early"])
def test_attacks_on_the_preallocated_path_drop_every_buffer(attack):
    ps = parts(chunk_len=50)
    dec, alloc = counting_decoder()
    dec.feed(ps[0])
    dec.feed(ps[1])
    dec.feed(ps[2])
    assert alloc.made and dec.held > 0
    if attack == "truncated":
        with pytest.raises(HandoffError, match="ended before its END record"):
            dec.result()
        assert dec.state == "error" and dec.held == 0 and dec._done == [] and dec._arr is None
        return
    bad = {"reordered": ps[4], "duplicate": ps[2], "end-early": ps[-1]}[attack]
    refused(dec, bad, "END says" if attack == "end-early" else "was due")
    assert dec._arr is None and dec._owners == []


def test_an_allocator_that_fails_or_lies_refuses_the_handoff():
    def failing(spec):
        raise MemoryError("no room")

    dec = HandoffDecoder(LAYOUT, CONTEXT, None, failing)
    dec.feed(parts()[0])
    refused(dec, parts()[1], "cannot make a")
    dec = HandoffDecoder(LAYOUT, CONTEXT, None, lambda spec: (np.zeros(3, np.uint8), None))
    dec.feed(parts()[0])
    refused(dec, parts()[1], "the allocator made")


# -- linear-attention state (ARRAYS) and several caches per layer (LIST) ---------------------------

STATE = LayerSpec(CacheKind.ARRAYS, arrays=(TensorSpec(DType.FLOAT32, (1, 3, 24)),
                                            TensorSpec(DType.BFLOAT16, (1, 4, 8, 8))))  # conv and recurrent state
PAIR = LayerSpec(CacheKind.LIST, parts=(KV, LayerSpec(CacheKind.KV, DType.FLOAT32, 1, 4, 4)))  # attention + indexer
MIXED = KVLayout((STATE, KV, PAIR, SLIDING, STATE))


@pytest.mark.parametrize("chunk_len", [1, 7, 1000])
def test_arrays_and_list_layers_round_trip_beside_the_old_kinds(chunk_len):
    sent = tensors_for(MIXED, len(PROMPT))
    dec = decoder(MIXED)
    for part in parts(MIXED, chunk_len=chunk_len):
        dec.feed(part)
    got = dec.result()
    assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(got.tensors, sent))
    assert [t.shape for t in got.tensors][:2] == [(1, 3, 24), (1, 4, 8, 8)]  # a state's arrays, whole
    assert [len(ts) for _, ts in got.layer_tensors()] == [2, 2, 4, 2, 2]


def test_a_state_is_the_same_size_whatever_the_prompt():
    layout = KVLayout((STATE,))
    assert layout.nbytes(1) == layout.nbytes(10_000) == 3 * 24 * 4 + 4 * 8 * 8 * 2


def test_arrays_and_list_records_are_the_documented_ones():
    header = encode_header({}, (7, 8), KVLayout((STATE, PAIR)))
    records = header[-24 * 6:]
    assert len(header) == 10 + 2 + 4 + 8 + 2 + 24 * 6  # 2 layers, 6 records: ARRAYS + 2 ARRAY, LIST + 2 KV
    assert records[:24] == LAYER_RECORD.pack(CacheKind.ARRAYS, 0, 0, 0, 0, 0, 2, 2, 0)
    assert records[24:48] == ARRAY_RECORD.pack(CacheKind.ARRAY, DType.FLOAT32, 3, 0, 1, 3, 24, 0, 0)
    assert records[48:72] == ARRAY_RECORD.pack(CacheKind.ARRAY, DType.BFLOAT16, 4, 0, 1, 4, 8, 8, 0)
    assert records[72:96] == LAYER_RECORD.pack(CacheKind.LIST, 0, 0, 0, 0, 0, 2, 2, 0)
    assert records[96:120] == LAYER_RECORD.pack(CacheKind.KV, DType.FLOAT32, 2, 8, 8, 2, 2, 0, 0)
    assert records[120:] == LAYER_RECORD.pack(CacheKind.KV, DType.FLOAT32, 1, 4, 4, 2, 2, 0, 0)


@pytest.mark.parametrize("theirs, words", [
    (LayerSpec(CacheKind.ARRAYS, arrays=(TensorSpec(DType.FLOAT32, (1, 3, 25)), STATE.arrays[1])), "array"),
    (LayerSpec(CacheKind.ARRAYS, arrays=(STATE.arrays[1], STATE.arrays[0])), "bfloat16"),
    (LayerSpec(CacheKind.ARRAYS, arrays=(TensorSpec(DType.FLOAT32, (1, 3, 24)),
                                         TensorSpec(DType.BFLOAT16, (1, 4, 8, 8, 1)))), "5 dimensions"),
    (LayerSpec(CacheKind.LIST, parts=(KV, KV, KV)), "list of 3"),
    (KV, "kv float32"),
])
def test_a_state_or_list_record_that_differs_from_the_model_is_refused(theirs, words):
    ours = KVLayout((STATE, PAIR))
    mine, other = (theirs, PAIR) if theirs.kind is CacheKind.ARRAYS else (STATE, theirs)
    header = encode_header(META, PROMPT, KVLayout((mine, other)))
    if len(header) != len(encode_header(META, PROMPT, ours)):
        refused(decoder(ours), header, "layer records make it")
    else:
        err = refused(decoder(ours), header, "layer", words)
        assert err.code is ErrorCode.BAD_TENSOR


def test_an_arrays_record_claiming_more_arrays_is_refused():
    header = bytearray(encode_header(META, PROMPT, KVLayout((STATE,))))
    start = len(header) - 3 * 24
    record = list(LAYER_RECORD.unpack_from(header, start))
    record[7] = 3  # three arrays, with only two ARRAY records after it
    header[start:start + 24] = LAYER_RECORD.pack(*record)
    refused(decoder(KVLayout((STATE,))), bytes(header), "layer 0", "arrays of 3")


def test_random_corruption_of_a_state_header_never_escapes_as_another_error():
    header = encode_header(META, PROMPT, MIXED)
    rng = random.Random(23)
    for _ in range(1000):
        bad = bytearray(header)
        for _ in range(rng.randint(1, 4)):
            bad[rng.randrange(len(bad))] = rng.randrange(256)
        dec = decoder(MIXED)
        try:
            dec.feed(bytes(bad))
        except HandoffError:
            continue
        assert dec.state == "chunks" and dec.expected <= MIXED.nbytes(CONTEXT)


@pytest.mark.parametrize("build, words", [
    (lambda: LayerSpec(CacheKind.ARRAYS), "holds 0 items"),
    (lambda: LayerSpec(CacheKind.ARRAYS, arrays=(STATE.arrays[0],) * (MAX_KV_ARRAYS + 1)), "holds 9 items"),
    (lambda: LayerSpec(CacheKind.ARRAYS, arrays=(TensorSpec(DType.FLOAT32, (1,) * 6),)), "of 6 dimensions"),
    (lambda: LayerSpec(CacheKind.ARRAYS, arrays=(TensorSpec(DType.FLOAT32, (1, 0)),)), "each 1..2^32-1"),
    (lambda: LayerSpec(CacheKind.LIST, parts=(PAIR,)), "inside a CacheList"),
    (lambda: LayerSpec(CacheKind.KV, DType.FLOAT32, 70_000, 8, 8), "at most 65535"),
    (lambda: LayerSpec(CacheKind.KV), "needs a dtype"),
])
def test_a_model_the_records_cannot_describe_is_refused_when_its_layout_is_made(build, words):
    with pytest.raises(ValueError, match=words.replace("^", r"\^").replace(".", r"\.")):
        build()
