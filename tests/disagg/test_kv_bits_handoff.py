"""A quantized KV cache (``--kv-bits``) through the handoff: QUANTIZED records, exact continuation, and a decode
node whose KV precision differs refuses the handoff by name."""

from __future__ import annotations

import asyncio

import pytest
from mlx_lm.models.cache import QuantizedKVCache

from mlxcel.disagg.kv_cache import probe_layout
from mlxcel.disagg.kv_codec import HandoffDecoder, HandoffError, encode_header
from mlxcel.disagg.wire import CacheKind
from mlxcel.engine.kv_quant import KVQuant, use_kv_bits
from tests.disagg.test_kv_cache import OTHER, PROMPT, greedy, handed_over, load, local
from tests.engine.fakes import collect_tokens
from tests.engine.test_kv_bits import make_llama


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_llama(tmp_path_factory, "kv-handoff-llama")


def quantized(path, bits: int = 8):
    loaded = load(path)
    use_kv_bits(loaded.model, KVQuant(bits, 32))
    return loaded


@pytest.mark.parametrize("bits", [4, 8])
def test_a_quantized_handoff_continues_exactly_like_one_node_with_kv_bits(llama_dir, bits):
    loaded = quantized(llama_dir, bits)

    async def main():
        with local(loaded) as sched:
            ref = [await collect_tokens(sched.submit(greedy(p, f"ref{i}"))) for i, p in enumerate((PROMPT, OTHER))]
        first, cache, layout = handed_over(loaded, greedy(PROMPT, "h"))
        assert {(s.kind, s.bits, s.group_size) for s in layout.layers} == {(CacheKind.QUANTIZED, bits, 32)}
        assert all(type(c) is QuantizedKVCache for c in cache)
        with local(loaded) as sched:
            other = sched.submit(greedy(OTHER, "other"))  # batched beside the adopted row
            adopted = sched.submit_prefilled(greedy(PROMPT, "h"), first, cache)
            got = [await collect_tokens(adopted), await collect_tokens(other)]
        assert got == ref

    asyncio.run(main())


@pytest.mark.parametrize("sender_bits,receiver_bits", [(8, None), (None, 8), (8, 4)])
def test_a_decode_node_refuses_a_handoff_of_another_kv_precision(llama_dir, sender_bits, receiver_bits):
    sender = quantized(llama_dir, sender_bits) if sender_bits else load(llama_dir)
    receiver = quantized(llama_dir, receiver_bits) if receiver_bits else load(llama_dir)
    dec = HandoffDecoder(probe_layout(receiver.model), 2048)
    with pytest.raises(HandoffError, match="layer 0: .* does not match this model's"):
        dec.feed(encode_header({"n": 1}, PROMPT, probe_layout(sender.model)))
