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


@pytest.mark.proc
@pytest.mark.timeout(180)
def test_a_disaggregated_cluster_with_kv_bits_equals_one_device_with_them(tmp_path_factory, llama_dir):
    """Router, prefill and decode processes on loopback, both KV roles with --kv-bits 4: the handoff carries the
    quantized records and the text is one device's 4-bit text (not the full-precision one)."""
    from tests.disagg.cluster import FAST, DisaggCluster
    from tests.pipeline.test_kv_bits import quantized_reference
    from tests.pipeline.test_remote import remote_tokens

    prompt, n = [1, 40, 41, 42, 43, 44], 16
    cluster = DisaggCluster(tmp_path_factory.mktemp("kv-disagg"), llama_dir,
                            node_flags=(*FAST, "--kv-bits", "4", "--kv-group-size", "32")).start()
    try:
        got = remote_tokens(cluster.url, prompt, n)
        handoffs = cluster.stats()
    finally:
        cluster.stop()
    assert got == quantized_reference(llama_dir, prompt, n, 4) != quantized_reference(llama_dir, prompt, n, None)
    sent = handoffs["metrics"]
    # 6 prompt tokens x 4 layers x K,V x 2 heads: 4-bit is 32 x 4 / 8 B packed + 2 x 4 B scale and bias (24 B) a
    # head and position, full precision 32 x 4 B (128 B)
    assert sent["router_handoffs"] == 1 and 6 * 4 * 2 * 2 * 24 <= sent["router_handoff_bytes"] < 6 * 4 * 2 * 2 * 128
