"""int64 arrays in a KV handoff (docs/disagg.md §4.1, dtype 5): attacks on the sans-I/O decoder. The
receiver's own layout decides whether an array is int64 and its shape; a window of token ids must be the
prompt's own last ids. Each refusal is by name, leaves the decoder refused and keeps no tensor byte."""

from __future__ import annotations

import numpy as np
import pytest

from mlxcel.disagg.kv_codec import HandoffDecoder, HandoffError, KVLayout, LayerSpec, TensorSpec, encode_chunks
from mlxcel.disagg.kv_codec import encode_header
from mlxcel.disagg.wire import CacheKind, DType
from mlxcel.error_codes import ErrorCode

PROMPT = (7, 8, 9)
KV = LayerSpec(CacheKind.KV, DType.FLOAT32, 1, 2, 2)


def ngram(window: int = 2, dtype: DType = DType.INT64) -> KVLayout:
    """longcat_flash_ngram's shape: an ARRAYS layer keeping the last ``window`` ids, then a KV layer."""
    return KVLayout((LayerSpec(CacheKind.ARRAYS, arrays=(TensorSpec(dtype, (1, 1)),), max_size=window), KV))


def tensors(ids: list[int], dtype=np.int64) -> list[np.ndarray]:
    kv = np.arange(3 * 2, dtype=np.float32).reshape(1, 1, 3, 2)
    return [np.array([ids], dtype), kv, -kv]


def send(receiver: KVLayout, sender: KVLayout, sent: list[np.ndarray], prompt=PROMPT) -> HandoffDecoder:
    dec = HandoffDecoder(receiver, 64, vocab_size=100)
    for part in [encode_header({"nonce": "0123456789abcdef"}, prompt, sender), *encode_chunks(sent, 24)]:
        dec.feed(part)
    return dec


def refused(receiver: KVLayout, sender: KVLayout, sent: list[np.ndarray], prompt=PROMPT) -> HandoffError:
    dec = HandoffDecoder(receiver, 64, vocab_size=100)
    with pytest.raises(HandoffError) as info:
        for part in [encode_header({"nonce": "0123456789abcdef"}, prompt, sender), *encode_chunks(sent, 24)]:
            dec.feed(part)
        dec.result()
    assert dec.state == "error" and dec.held == 0
    with pytest.raises(HandoffError, match="already refused"):
        dec.feed(b"\x03")
    return info.value


def test_the_prompts_last_ids_travel_as_int64():
    got = send(ngram(), ngram(), tensors([8, 9])).result()
    assert got.tensors[0].dtype == np.int64 and got.tensors[0].tolist() == [[8, 9]]
    short = send(ngram(5), ngram(5), tensors([7, 8, 9])).result()  # P = 3 < W = 5: all three
    assert short.tensors[0].tolist() == [[7, 8, 9]]


def test_an_int64_array_where_the_model_keeps_float32_is_refused_by_its_header():
    exc = refused(ngram(dtype=DType.FLOAT32), ngram(), tensors([8, 9]))
    assert exc.code is ErrorCode.BAD_TENSOR
    assert "layer 0: arrays" in str(exc) and "array int64 of 2 dimensions [1, 2, 0, 0, 0]" in str(exc)
    assert "array float32 of 2 dimensions [1, 2, 0, 0, 0]" in str(exc)


def test_a_float32_array_where_the_model_keeps_int64_is_refused():
    exc = refused(ngram(), ngram(dtype=DType.FLOAT32), tensors([8, 9], np.float32))
    assert "array float32" in str(exc) and "this model's arrays" in str(exc)


def test_another_window_length_is_refused_by_its_header():
    """A sender claiming W = 3 (three ids, [1, 3]) to a model keeping 2."""
    exc = refused(ngram(2), ngram(3), tensors([7, 8, 9]))
    assert "[1, 3, 0, 0, 0]" in str(exc) and "[1, 2, 0, 0, 0]" in str(exc)


def test_four_bytes_per_int64_element_end_short():
    """The right header, then the ids as int32 (8 bytes where 16 are due): END does not add up."""
    exc = refused(ngram(), ngram(), tensors([8, 9], np.int32))
    assert "tensor bytes" in str(exc) and exc.code is ErrorCode.BAD_TENSOR


@pytest.mark.parametrize("ids", [[9, 8], [8, 10], [8, -1], [8, 2**62], [0, 0]])
def test_ids_that_are_not_the_prompts_last_are_refused(ids):
    """Out-of-vocabulary, negative, huge or merely other ids: the window holds exactly the prompt's tail."""
    exc = refused(ngram(), ngram(), tensors(ids))
    assert exc.code is ErrorCode.BAD_TENSOR
    assert str(exc) == ("cache 0's int64 array 0 is not the prompt's last 2 token ids (an n-gram window holds "
                        "exactly those)")


def test_int64_is_never_a_layer_records_dtype():
    with pytest.raises(ValueError, match="int64 is an ARRAY's dtype only"):
        LayerSpec(CacheKind.KV, DType.INT64, 1, 2, 2)


def test_a_window_beyond_its_record_field_cannot_be_made():
    with pytest.raises(ValueError, match="window of 4294967296 ids cannot travel"):
        ngram(2**32)
