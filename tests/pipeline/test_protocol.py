"""The stage protocol's codec: round trips, malformed envelopes and tensors, and a fuzz test of ``decode``."""

from __future__ import annotations

import json
import struct

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlxcel.pipeline.protocol import (
    ENVELOPE,
    MAX_HEADER_LEN,
    ErrorCode,
    MsgType,
    ProtocolError,
    check_hidden,
    check_ids,
    decode,
    encode,
    new_nonce,
)
from mlxcel.pipeline.tensors import from_wire, ids_to_wire, to_wire


def envelope(mtype: int, body: bytes, rest: bytes = b"") -> bytes:
    return ENVELOPE.pack(mtype, len(body)) + body + rest


def with_specs(specs: list, data: bytes, mtype: MsgType = MsgType.PREPARE, **header) -> bytes:
    """A JSON-header message with hand-written tensor descriptors."""
    return envelope(int(mtype), json.dumps({**header, "tensors": specs}).encode(), data)


def step(**fields) -> dict:
    """The field dict of a valid step message (overridden by ``fields``)."""
    return {"nonce": new_nonce(), "phase": "decode", "micro_batch": 0, "request_ids": ["r"], "sample": True, **fields}


def raw_step(mtype: MsgType, *, nonce: bytes = bytes(8), phase: int = 1, flags: int = 1, micro_batch: int = 0,
             ids: list[bytes] = (b"r",), rows: int | None = None, tail: bytes = b"", data: bytes = b"") -> bytes:
    """A step message built byte by byte (what ``encode`` would never produce)."""
    body = struct.pack(">8sBBBB", nonce, phase, flags, micro_batch, len(ids) if rows is None else rows)
    body += b"".join(bytes([len(i)]) + i for i in ids) + tail
    return envelope(int(mtype), body, data)


def descriptor(code: int, *dims: int) -> bytes:
    return struct.pack(">BB", code, len(dims)) + b"".join(struct.pack(">I", d) for d in dims)


def refused(payload: bytes, code: ErrorCode) -> ProtocolError:
    with pytest.raises(ProtocolError) as exc:
        decode(payload)
    assert exc.value.code is code, exc.value
    return exc.value


# -- round trips ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_float_tensors_round_trip_bit_exactly(dtype):
    x = (mx.random.normal((2, 3, 8)) * 100).astype(dtype)
    header = {"nonce": "00ff00ff00ff00ff", "phase": "decode", "micro_batch": 1, "request_ids": ["a", "b"], "sample": True}
    m = decode(encode(MsgType.ACTIVATION, header, {"hidden": to_wire(x)}))
    assert m.type is MsgType.ACTIVATION and m.header == header and m.nonce == "00ff00ff00ff00ff"
    assert m.request_ids == ["a", "b"]
    y = from_wire(m.dtypes["hidden"], m.tensors["hidden"])
    assert y.dtype == dtype and y.shape == x.shape
    assert mx.array_equal(y.view(mx.uint16 if dtype != mx.float32 else mx.uint32),
                          x.view(mx.uint16 if dtype != mx.float32 else mx.uint32)).item()


def test_json_messages_carry_several_tensors():
    ids = ids_to_wire([[1, 2, 3]])
    scale = ("float32", np.array([0.5, -2.0], dtype=np.float32))
    payload = encode(MsgType.PREPARE, {"nonce": "n"}, {"input_ids": ids, "scale": scale})
    m = decode(payload)
    assert m.dtypes == {"input_ids": "int32", "scale": "float32"}
    assert m.tensors["input_ids"].tolist() == [[1, 2, 3]] and m.tensors["scale"].tolist() == [0.5, -2.0]
    assert "tensors" not in m.header  # descriptors are consumed, not handed to the receiver
    assert len(payload) == ENVELOPE.size + len(json.dumps({"nonce": "n", "tensors": [
        {"name": "input_ids", "dtype": "int32", "shape": [1, 3]},
        {"name": "scale", "dtype": "float32", "shape": [2]}]}, separators=(",", ":"))) + 12 + 8


def test_a_step_message_carries_at_most_one_tensor():
    with pytest.raises(ValueError):
        encode(MsgType.RUN_ENTRY, step(), {"input_ids": ids_to_wire([[1]]), "more": ids_to_wire([[2]])})


@pytest.mark.parametrize("fields", [
    {"tokens": None},
    {"tokens": [3, 4], "logprobs": None, "top_logprobs": None},
    {"tokens": [3, 4], "logprobs": [-0.25, None], "top_logprobs": [[[3, -0.25], [9, -1.5]], []]},
], ids=["chunk", "tokens", "logprobs"])
def test_run_results_round_trip(fields):
    header = step(request_ids=["a", "b"], **fields)
    m = decode(encode(MsgType.RUN_RESULT, header))
    expected = {"logprobs": None, "top_logprobs": None, **header}
    assert m.header == expected and m.tensors == {}


def test_a_logits_result_carries_its_tensor():
    logits = np.arange(6, dtype=np.float32).reshape(2, 3)
    m = decode(encode(MsgType.RUN_RESULT, step(request_ids=["a", "b"], tokens=None), {"logits": ("float32", logits)}))
    assert m.header["tokens"] is None and m.tensors["logits"].tolist() == logits.tolist()


def test_a_step_header_is_a_few_dozen_bytes():
    """The per-token messages' fixed binary header (docs/pipeline.md §3.4): 12 bytes + ids + descriptor."""
    payload = encode(MsgType.RUN_ENTRY, step(request_ids=["req-7"]), {"input_ids": ids_to_wire([[504]])})
    assert len(payload) == ENVELOPE.size + 12 + (1 + 5) + (2 + 2 * 4) + 4


def test_tensors_are_little_endian_row_major_on_the_wire():
    payload = encode(MsgType.RUN_ENTRY, step(), {"input_ids": ("int32", np.array([[1, 256]], dtype=np.int32))})
    assert payload.endswith(struct.pack("<ii", 1, 256))


@pytest.mark.parametrize("mtype", sorted(set(MsgType) - {MsgType.RUN_ENTRY, MsgType.ACTIVATION, MsgType.RUN_RESULT}),
                         ids=lambda t: t.name)
def test_every_json_message_type_without_tensors(mtype):
    m = decode(encode(mtype, {"nonce": "x", "code": "internal"}))
    assert (m.type, m.header, m.tensors) == (mtype, {"nonce": "x", "code": "internal"}, {})


def test_decode_takes_a_memoryview_and_does_not_copy_tensors():
    buf = bytearray(encode(MsgType.ACTIVATION, step(), {"hidden": ("float32", np.ones((1, 1, 4), np.float32))}))
    m = decode(memoryview(buf))
    buf[-4:] = struct.pack("<f", 7.0)
    assert m.tensors["hidden"][0, 0, 3] == 7.0


# -- malformed envelopes -------------------------------------------------------------------------


@pytest.mark.parametrize("payload", [b"", b"\x01", b"\x01\x00\x00\x00"], ids=["empty", "1 byte", "4 bytes"])
def test_shorter_than_the_envelope(payload):
    assert refused(payload, ErrorCode.BAD_REQUEST).partial is None


@pytest.mark.parametrize("mtype", [0, 11, 15, 19, 255])
def test_unknown_message_type(mtype):
    refused(envelope(mtype, b"{}"), ErrorCode.BAD_REQUEST)


def test_header_past_the_end():
    refused(ENVELOPE.pack(1, 10) + b"{}", ErrorCode.BAD_REQUEST)
    refused(ENVELOPE.pack(1, MAX_HEADER_LEN + 1) + b"{}", ErrorCode.BAD_REQUEST)
    refused(ENVELOPE.pack(1, 2**32 - 1) + b"{}", ErrorCode.BAD_REQUEST)


@pytest.mark.parametrize("body", [
    b"not json", b"\xff\xfe{}", b"{'a': 1}", b"{\"a\": 1", b"[" * 100_000, b"{\"a\": " + b"1" * 5000 + b"}",
], ids=["text", "not utf-8", "single quotes", "truncated", "nested too deep", "integer too long"])
def test_header_not_json(body):
    assert refused(envelope(1, body), ErrorCode.BAD_REQUEST).partial is None


@pytest.mark.parametrize("body", [b"[]", b"1", b"\"s\"", b"null"])
def test_header_not_an_object(body):
    refused(envelope(1, body), ErrorCode.BAD_REQUEST)


def test_trailing_bytes():
    refused(envelope(1, b"{}", b"\x00"), ErrorCode.BAD_TENSOR)
    payload = encode(MsgType.RUN_ENTRY, step(), {"input_ids": ids_to_wire([[1]])})
    refused(payload + b"\x00", ErrorCode.BAD_TENSOR)


# -- malformed tensors: refused before anything is allocated, the header kept for the answer -------


@pytest.mark.parametrize("specs,data", [
    ([{"name": "hidden", "dtype": "int8", "shape": [1, 1, 4]}], bytes(4)),
    ([{"name": "hidden", "dtype": "q4", "shape": [1, 1, 8]}], bytes(4)),
    ([{"name": "hidden", "dtype": "float64", "shape": [1, 1, 1]}], bytes(8)),
    ([{"name": "hidden", "shape": [1, 1, 1]}], bytes(4)),
    ([{"name": "hidden", "dtype": "float32", "shape": [1, 2**30, 2**20]}], bytes(4)),
    ([{"name": "hidden", "dtype": "float32", "shape": [1, 2, 4]}], bytes(16)),
    ([{"name": "hidden", "dtype": "float32", "shape": []}], bytes(4)),
    ([{"name": "hidden", "dtype": "float32", "shape": [1, 1, 1, 1]}], bytes(4)),
    ([{"name": "hidden", "dtype": "float32", "shape": [1, 0, 4]}], b""),
    ([{"name": "hidden", "dtype": "float32", "shape": [1, -1, 4]}], bytes(4)),
    ([{"name": "hidden", "dtype": "float32", "shape": [1, True, 4]}], bytes(16)),
    ([{"name": "hidden", "dtype": "float32", "shape": [1, 1.0, 4]}], bytes(16)),
    ([{"name": "hidden", "dtype": "float32", "shape": "1,1,4"}], bytes(16)),
    ([{"dtype": "float32", "shape": [1]}], bytes(4)),
    (["hidden"], b""),
    ({"name": "hidden"}, b""),
    ([{"name": f"t{i}", "dtype": "int32", "shape": [1]} for i in range(5)], bytes(20)),
], ids=["int8", "q4", "float64", "no dtype", "huge claim", "short data", "rank 0", "rank 4", "zero dim",
        "negative dim", "bool dim", "float dim", "shape string", "no name", "spec not object",
        "specs not list", "five tensors"])
def test_bad_tensor_descriptors(specs, data):
    exc = refused(with_specs(specs, data, nonce="abc", request_ids=["r"]), ErrorCode.BAD_TENSOR)
    assert exc.partial is not None and exc.partial.type is MsgType.PREPARE
    assert exc.partial.nonce == "abc" and exc.partial.request_ids == ["r"] and exc.partial.tensors == {}


def test_request_ids_that_are_not_a_list_of_strings_read_as_none():
    for value in (5, "abc", [1], [{"id": 1}], None, {"a": 1}):
        assert decode(encode(MsgType.PREPARE, {"request_ids": value})).request_ids == []


# -- malformed step headers: bad_request (bad_tensor for a descriptor), the ids kept when they decoded --


@pytest.mark.parametrize("payload,code,partial", [
    (envelope(2, bytes(11)), ErrorCode.BAD_REQUEST, False),
    (raw_step(MsgType.RUN_ENTRY, phase=2, tail=descriptor(1, 1, 1), data=bytes(4)), ErrorCode.BAD_REQUEST, True),
    (raw_step(MsgType.RUN_ENTRY, flags=3, tail=descriptor(1, 1, 1), data=bytes(4)), ErrorCode.BAD_REQUEST, True),
    (raw_step(MsgType.RUN_ENTRY, micro_batch=64, tail=descriptor(1, 1, 1), data=bytes(4)), ErrorCode.BAD_REQUEST, True),
    (raw_step(MsgType.RUN_ENTRY, ids=[], tail=descriptor(1, 1, 1), data=bytes(4)), ErrorCode.BAD_REQUEST, True),
    (raw_step(MsgType.RUN_ENTRY, ids=[b""], tail=descriptor(1, 1, 1), data=bytes(4)), ErrorCode.BAD_REQUEST, True),
    (raw_step(MsgType.RUN_ENTRY, ids=[b"x" * 129], tail=descriptor(1, 1, 1), data=bytes(4)), ErrorCode.BAD_REQUEST, True),
    (raw_step(MsgType.RUN_ENTRY, ids=[b"\xff\xfe"], tail=descriptor(1, 1, 1), data=bytes(4)), ErrorCode.BAD_REQUEST, True),
    (raw_step(MsgType.RUN_ENTRY, ids=[b"a", b"a"], tail=descriptor(1, 2, 1), data=bytes(8)), ErrorCode.BAD_REQUEST, True),
    (raw_step(MsgType.RUN_ENTRY, rows=3, ids=[b"a"]), ErrorCode.BAD_REQUEST, True),
    (raw_step(MsgType.RUN_ENTRY), ErrorCode.BAD_REQUEST, True),
    (raw_step(MsgType.RUN_ENTRY, tail=descriptor(1, 1, 1) + b"\x00", data=bytes(4)), ErrorCode.BAD_REQUEST, True),
    (raw_step(MsgType.RUN_ENTRY, tail=descriptor(9, 1, 1), data=bytes(4)), ErrorCode.BAD_TENSOR, True),
    (raw_step(MsgType.RUN_ENTRY, tail=descriptor(1), data=b""), ErrorCode.BAD_TENSOR, True),
    (raw_step(MsgType.RUN_ENTRY, tail=descriptor(1, 1, 1, 1, 1), data=bytes(4)), ErrorCode.BAD_TENSOR, True),
    (raw_step(MsgType.RUN_ENTRY, tail=descriptor(1, 1, 2**31), data=bytes(4)), ErrorCode.BAD_TENSOR, True),
    (raw_step(MsgType.RUN_ENTRY, tail=descriptor(1, 1, 2), data=bytes(4)), ErrorCode.BAD_TENSOR, True),
    (raw_step(MsgType.RUN_ENTRY, tail=descriptor(1, 1, 0), data=b""), ErrorCode.BAD_TENSOR, True),
    (raw_step(MsgType.RUN_RESULT, tail=b"\x07"), ErrorCode.BAD_REQUEST, True),
    (raw_step(MsgType.RUN_RESULT, tail=b"\x01" + bytes(4) + b"\x02\x00"), ErrorCode.BAD_REQUEST, True),
    (raw_step(MsgType.RUN_RESULT, tail=b"\x01" + bytes(4) + b"\x00\x01\x15" + bytes(8 * 21)), ErrorCode.BAD_REQUEST, True),
    (raw_step(MsgType.RUN_RESULT, tail=b"\x01\x00\x00"), ErrorCode.BAD_REQUEST, True),
], ids=["short fixed part", "phase 2", "unknown flag", "micro_batch 64", "no rows", "empty id", "129-byte id",
        "id not utf-8", "id twice", "fewer ids than rows", "no descriptor", "bytes after the fields",
        "dtype code 9", "rank 0", "rank 4", "dimension 2**31", "short data", "zero dimension",
        "result kind 7", "logprobs flag 2", "21 top_logprobs", "tokens cut short"])
def test_malformed_step_headers(payload, code, partial):
    exc = refused(payload, code)
    assert (exc.partial is not None) == partial  # past the 12 fixed bytes, the nonce is known: answerable
    if partial:
        assert exc.partial.nonce == "00" * 8 and exc.partial.request_ids in (["r"], [], ["a", "a"])


@pytest.mark.parametrize("fields", [{"phase": 2}, {"phase": 255}, {"flags": 2}, {"flags": 0x80}, {"micro_batch": 64},
                                    {"micro_batch": 255}, {"ids": [b"r", b"r"]}], ids=str)
def test_a_refused_step_header_keeps_its_ids(fields):
    """A wrong fixed byte or an id twice: the ids still decoded, so the refusal can reach their owner (§4.5)."""
    rows = len(fields.get("ids", [b"r"]))
    exc = refused(raw_step(MsgType.ACTIVATION, **fields, tail=descriptor(3, rows, 1, 4), data=bytes(16 * rows)),
                  ErrorCode.BAD_REQUEST)
    assert exc.partial is not None and exc.partial.request_ids == ["r"] * rows


# -- receiver bounds ------------------------------------------------------------------------------


def _activation(x: np.ndarray, dtype: str = "float32", **header):
    h = step(**{"request_ids": [f"r{i}" for i in range(x.shape[0])], **header})
    return decode(encode(MsgType.ACTIVATION, h, {"hidden": (dtype, x)}))


def test_check_hidden_accepts_the_bounds():
    assert check_hidden(_activation(np.zeros((4, 1, 8), np.float32)), max_rows=4, width=8).shape == (4, 1, 8)
    m = _activation(np.zeros((1, 9, 8), np.float32), phase="prefill")
    assert check_hidden(m, max_rows=4, width=8).shape == (1, 9, 8)


@pytest.mark.parametrize("make,code", [
    (lambda: _activation(np.zeros((1, 1, 7), np.float32)), ErrorCode.BAD_TENSOR),
    (lambda: _activation(np.zeros((5, 1, 8), np.float32)), ErrorCode.BAD_TENSOR),
    (lambda: _activation(np.zeros((2, 1, 8), np.float32), request_ids=["a"]), ErrorCode.BAD_TENSOR),
    (lambda: _activation(np.zeros((1, 2, 8), np.float32)), ErrorCode.BAD_TENSOR),
    (lambda: _activation(np.zeros((2, 2, 8), np.float32), phase="prefill"), ErrorCode.BAD_TENSOR),
    (lambda: _activation(np.zeros((1, 1, 8), np.int32), dtype="int32"), ErrorCode.BAD_TENSOR),
], ids=["width", "rows > max", "rows != ids", "decode n=2", "prefill 2 rows", "int32"])
def test_check_hidden_refuses(make, code):
    with pytest.raises(ProtocolError) as exc:
        check_hidden(make(), max_rows=4, width=8)
    assert exc.value.code is code


@pytest.mark.parametrize("ids,dtype,code", [
    (np.array([[1.0]], np.float32), "float32", ErrorCode.BAD_TENSOR),
    (np.array([1], np.int32), "int32", ErrorCode.BAD_TENSOR),
    (np.array([[[1]]], np.int32), "int32", ErrorCode.BAD_TENSOR),
    (np.array([[10]], np.int32), "int32", ErrorCode.BAD_TENSOR),
    (np.array([[-1]], np.int32), "int32", ErrorCode.BAD_TENSOR),
    (np.array([[1, 2]], np.int32), "int32", ErrorCode.BAD_TENSOR),
])
def test_check_ids_refuses(ids, dtype, code):
    m = decode(encode(MsgType.RUN_ENTRY, step(), {"input_ids": (dtype, ids)}))
    with pytest.raises(ProtocolError) as exc:
        check_ids(m, max_rows=4, vocab_size=10)
    assert exc.value.code is code


def test_check_ids_accepts_uint32_within_the_vocabulary():
    m = decode(encode(MsgType.RUN_ENTRY, step(phase="prefill"),
                      {"input_ids": ("uint32", np.array([[0, 9]], np.uint32))}))
    assert check_ids(m, max_rows=4, vocab_size=10).tolist() == [[0, 9]]


# -- fuzz -------------------------------------------------------------------------------------------


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=256))
def test_decode_raises_only_protocol_error_on_random_bytes(data):
    try:
        decode(data)
    except ProtocolError:
        pass


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
                     max_leaves=12)
_spec = st.fixed_dictionaries({}, optional={
    "name": st.text(max_size=6) | st.integers(),
    "dtype": st.sampled_from(["float32", "float16", "bfloat16", "int32", "uint32", "int8", "q4", ""]) | _json,
    "shape": st.lists(st.integers(min_value=-2, max_value=2**27), max_size=4) | _json,
})


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mtype=st.integers(0, 255), header=st.dictionaries(st.text(max_size=8), _json, max_size=4),
       specs=st.lists(_spec, max_size=5) | _json, data=st.binary(max_size=64))
def test_decode_raises_only_protocol_error_on_structured_garbage(mtype, header, specs, data):
    """Well-formed envelopes around adversarial headers and descriptors: the paths random bytes rarely reach."""
    try:
        m = decode(envelope(mtype, json.dumps({**header, "tensors": specs}).encode(), data))
    except ProtocolError:
        return
    _ = (m.nonce, m.request_ids)
    for name, arr in m.tensors.items():
        assert arr.nbytes <= len(data) and isinstance(name, str)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mtype=st.sampled_from([MsgType.RUN_ENTRY, MsgType.ACTIVATION, MsgType.RUN_RESULT]),
       body=st.binary(max_size=96), data=st.binary(max_size=64))
def test_decode_raises_only_protocol_error_on_garbage_step_headers(mtype, body, data):
    """Random binary step headers: refused with a ProtocolError, or decoded into well-typed fields."""
    try:
        m = decode(envelope(int(mtype), body, data))
    except ProtocolError:
        return
    h = m.header
    assert len(h["nonce"]) == 16 and h["phase"] in ("prefill", "decode") and 0 <= h["micro_batch"] < 64
    assert all(isinstance(r, str) and 0 < len(r) <= 128 for r in h["request_ids"]) and h["request_ids"]
    for arr in m.tensors.values():
        assert arr.nbytes <= len(data)
