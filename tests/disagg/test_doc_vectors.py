"""The worked examples of docs/disagg.md §4.4 and §4.5 are what the codec writes and reads."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from mlxcel.disagg.kv_codec import HandoffDecoder, KVLayout, LayerSpec, TensorSpec, encode_chunks, encode_header
from mlxcel.disagg.wire import CacheKind, DType

DOC = Path(__file__).resolve().parents[2] / "docs" / "disagg.md"


def example_parts(section: str = "### 4.4 Worked example") -> list[bytes]:
    text = DOC.read_text()
    block = text[text.index(section):]
    block = block[block.index("```") + 3:]
    block = block[:block.index("```")]
    parts, current = [], ""
    for line in block.strip().splitlines():
        label = re.match(r"(header|chunk|end)\s", line)
        if label:
            if current:
                parts.append(bytes.fromhex(current))
            current = line[label.end():]
        else:
            current += line
    parts.append(bytes.fromhex(current))
    return parts


def test_the_worked_example_matches_the_codec():
    layout = KVLayout((LayerSpec(CacheKind.KV, DType.FLOAT32, 1, 2, 2),))
    keys = np.array([[[[1.0, 2.0], [3.0, 4.0]]]], np.float32)
    written = [encode_header({"nonce": "0123456789abcdef"}, (7, 8), layout), *encode_chunks([keys, -keys], 24)]
    assert example_parts() == written
    dec = HandoffDecoder(layout, 16)
    for part in example_parts():
        dec.feed(part)
    got = dec.result()
    assert got.prompt == (7, 8) and np.array_equal(got.tensors[0], keys) and np.array_equal(got.tensors[1], -keys)


def test_the_state_and_list_example_matches_the_codec():
    state = LayerSpec(CacheKind.ARRAYS, arrays=(TensorSpec(DType.FLOAT32, (1, 3)), TensorSpec(DType.FLOAT32, (1, 1, 1, 2))))
    kv = LayerSpec(CacheKind.KV, DType.FLOAT32, 1, 1, 1)
    layout = KVLayout((state, LayerSpec(CacheKind.LIST, parts=(kv, kv))))
    sent = [np.array([[1.0, 2.0, 3.0]], np.float32), np.array([[[[4.0, 5.0]]]], np.float32),
            *(np.full((1, 1, 1, 1), v, np.float32) for v in (6.0, 7.0, 8.0, 9.0))]
    written = [encode_header({"nonce": "0123456789abcdef"}, (7,), layout), *encode_chunks(sent, 24)]
    parts = example_parts("### 4.5 Worked example")
    assert parts == written
    dec = HandoffDecoder(layout, 16)
    for part in parts:
        dec.feed(part)
    got = dec.result()
    assert got.prompt == (7,) and all(np.array_equal(a, b) for a, b in zip(got.tensors, sent))
    assert [t.shape for t in got.tensors][:2] == [(1, 3), (1, 1, 1, 2)]


def test_the_int64_window_example_matches_the_codec():
    """§4.5's second block: an ARRAYS layer keeping a window of W = 2 int64 token ids (dtype 5, 8 bytes each)."""
    layout = KVLayout((LayerSpec(CacheKind.ARRAYS, arrays=(TensorSpec(DType.INT64, (1, 1)),), max_size=2),))
    ids = np.array([[8, 9]], np.int64)
    written = [encode_header({"nonce": "0123456789abcdef"}, (7, 8, 9), layout), *encode_chunks([ids], 24)]
    parts = example_parts("With a window of int64 token ids")
    assert parts == written
    dec = HandoffDecoder(layout, 16)
    for part in parts:
        dec.feed(part)
    got = dec.result()
    assert got.prompt == (7, 8, 9) and got.tensors[0].dtype == np.int64 and got.tensors[0].tolist() == [[8, 9]]


def test_the_chunked_example_matches_the_codec():
    layout = KVLayout((LayerSpec(CacheKind.CHUNKED, DType.FLOAT32, 1, 1, 1, max_size=2),))
    keys = np.array([[[[2.0], [3.0]]]], np.float32)
    written = [encode_header({"nonce": "0123456789abcdef"}, (7, 8, 9), layout), *encode_chunks([keys, -keys], 24)]
    parts = example_parts("### 4.6 Worked example")
    assert parts == written
    dec = HandoffDecoder(layout, 16)
    for part in parts:
        dec.feed(part)
    got = dec.result()
    assert got.prompt == (7, 8, 9) and np.array_equal(got.tensors[0], keys) and np.array_equal(got.tensors[1], -keys)


def split_example() -> dict[str, list[bytes]]:
    """docs/disagg.md §4.10: each stream's parts ("header stream", "part stream 0", ...), hex joined per part."""
    text = DOC.read_text()
    block = text[text.index("### 4.10 Worked example"):]
    block = block[block.index("```") + 3:]
    block = block[:block.index("```")]
    streams: dict[str, list[str]] = {}
    name = ""
    for line in block.strip().splitlines():
        label = re.match(r"(header stream|part stream \d)\s+", line)
        if label:
            name = label.group(1)
            streams[name] = []
            line = line[label.end():]
        else:
            line = line.strip()
        streams[name].append(line)
    return {k: [bytes.fromhex(p) for p in v if not p.startswith("(")] for k, v in streams.items()}


def test_the_split_example_matches_the_codec_and_decodes_as_the_single_stream():
    from mlxcel.disagg.kv_codec import contiguous_runs
    from mlxcel.disagg.kv_split import encode_part, encode_split, parse_part, range_parts, ranges

    layout = KVLayout((LayerSpec(CacheKind.KV, DType.FLOAT32, 1, 2, 2),))
    keys = np.array([[[[1.0, 2.0], [3.0, 4.0]]]], np.float32)
    example = split_example()
    assert example["header stream"] == [encode_split(3)]
    assert ranges(32, 3) == [(0, 10), (10, 21), (21, 32)]
    for i, (lo, hi) in enumerate(ranges(32, 3)):
        runs = (v for t in (keys, -keys) for v in contiguous_runs(t))
        written = [encode_part(5, i, 3), *(b"".join(bytes(b) for b in p) for p in range_parts(runs, lo, hi, 24))]
        assert example[f"part stream {i}"] == written
    dec = HandoffDecoder(layout, 16)
    dec.feed(example_parts()[0])  # the header of §4.4
    dec.feed(encode_split(3))
    for i in (2, 0, 1):  # any order of the part streams
        stream, index, count = parse_part(memoryview(example[f"part stream {i}"][0]), ValueError)
        assert (stream, index, count) == (5, i, 3)
        dec.start_part(index, count)
        for part in example[f"part stream {i}"][1:]:
            dec.feed_part(index, part)
    got = dec.result()
    assert np.array_equal(got.tensors[0], keys) and np.array_equal(got.tensors[1], -keys)
