"""The prefix cache: longest-prefix reuse, copies that leave the stored entry intact, byte-bounded LRU."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, ChunkedKVCache, KVCache, RotatingKVCache

from mlxcel.engine.prefix_cache import CUT, MIN_PREFIX, WHOLE, PrefixCache, reuse_kind

LAYERS = 2
BYTES_PER_TOKEN = LAYERS * 2 * (1 * 2 * 4) * 4  # layers x (keys, values) x [B=1, H=2, D=4] x float32


def kv(n: int, start: float = 0.0) -> list[KVCache]:
    """A filled cache of n positions; position i holds the value start + i."""
    layers = []
    for _ in range(LAYERS):
        c = KVCache()
        x = mx.broadcast_to((mx.arange(n, dtype=mx.float32) + start)[None, None, :, None], (1, 2, n, 4))
        c.update_and_fetch(x, x)
        layers.append(c)
    return layers


def positions(cache: list[KVCache]) -> list[float]:
    return cache[0].keys[0, 0, : cache[0].offset, 0].tolist()


def test_lookup_returns_the_longest_stored_prefix():
    pc = PrefixCache(1 << 20)
    pc.store(list(range(10)), kv(10))
    pc.store(list(range(6)) + [99, 98], kv(8, start=100))
    cache, n = pc.lookup(list(range(9)) + [50, 51])
    assert n == 9 and positions(cache) == list(range(9)) and all(c.offset == 9 for c in cache)
    cache, n = pc.lookup(list(range(6)) + [99, 7])
    assert n == 7 and positions(cache) == [100.0 + i for i in range(7)]
    assert (pc.hits, pc.reused_tokens) == (2, 16)


def test_a_reused_copy_can_grow_without_touching_the_stored_entry():
    pc = PrefixCache(1 << 20)
    pc.store(list(range(8)), kv(8))
    cache, n = pc.lookup(list(range(8)) + [40])
    for c in cache:
        c.update_and_fetch(mx.full((1, 2, 3, 4), -1.0), mx.full((1, 2, 3, 4), -1.0))
    again, m = pc.lookup(list(range(8)) + [40])
    assert (n, m) == (8, 8) and positions(again) == list(range(8)) and cache[0].offset == 11


def test_at_least_one_prompt_token_is_left_to_prefill():
    pc = PrefixCache(1 << 20)
    pc.store(list(range(10)), kv(10))
    cache, n = pc.lookup(list(range(10)))
    assert n == 9 and cache[0].offset == 9


def test_short_matches_and_caches_that_cannot_be_reused_are_not_used():
    pc = PrefixCache(1 << 20)
    pc.store(list(range(MIN_PREFIX - 1)), kv(MIN_PREFIX - 1))  # too short to be worth storing
    assert len(pc) == 0
    pc.store(list(range(10)), kv(10))
    assert pc.lookup(list(range(MIN_PREFIX - 1)) + [77, 78]) == (None, 0)
    chunked = ChunkedKVCache(8)
    chunked.update_and_fetch(mx.zeros((1, 2, 10, 32)), mx.zeros((1, 2, 10, 32)))
    pc.store(list(range(20, 30)), [chunked])  # a chunked cache is not kept (a quantized one is: test_kv_bits.py)
    empty = ArraysCache(2)
    pc.store(list(range(40, 50)), [empty])  # nor a state that was never written
    assert len(pc) == 1 and pc.hits == 0
    off = PrefixCache(0)
    off.store(list(range(10)), kv(10))
    assert len(off) == 0 and off.lookup(list(range(10))) == (None, 0)


def state_and_kv(n: int, mark: float) -> list:
    """A hybrid layer pair after n tokens: a linear-attention state (fixed shapes) and a KV layer."""
    state = ArraysCache(2)
    state[0], state[1] = mx.full((1, 3, 8), mark), mx.full((1, 2, 4, 4), mark + 1)
    return [state, kv(n)[0]]


def test_a_linear_attention_state_is_reused_only_whole():
    """An ArraysCache cannot be cut back to fewer tokens: its entry serves only prompts that start with all of
    it (the next turn of a chat), never one that diverges inside it, nor a pipeline's shorter agreed prefix."""
    pc = PrefixCache(1 << 20)
    pc.store(list(range(10)), state_and_kv(10, 5.0))
    assert reuse_kind(state_and_kv(3, 0.0)) == WHOLE and reuse_kind(kv(3)) == CUT
    cache, n = pc.lookup(list(range(10)) + [50, 51])
    assert n == 10 and isinstance(cache[0], ArraysCache) and cache[1].offset == 10
    assert mx.array_equal(cache[0][0], mx.full((1, 3, 8), 5.0)).item()
    assert pc.lookup(list(range(6)) + [77, 78, 79, 80, 81]) == (None, 0)  # diverges inside: no cut
    assert pc.lookup(list(range(10)) + [50], limit=8) == (None, 0)  # a pipeline agreed on 8: not 10
    assert pc.lookup(list(range(10))) == (None, 0)  # it would leave no token to prefill
    pc.store(list(range(6)) + [77, 78], kv(8))  # a cuttable entry still serves the diverging prompt
    assert pc.lookup(list(range(6)) + [77, 78, 79, 80, 81])[1] == 8


def test_a_reused_state_can_go_on_without_touching_the_stored_entry():
    pc = PrefixCache(1 << 20)
    pc.store(list(range(10)), state_and_kv(10, 5.0))
    cache, _ = pc.lookup(list(range(10)) + [1])
    cache[0][1] = mx.zeros((1, 2, 4, 4))  # what a model's step does: a new array in the state's slot
    again, _ = pc.lookup(list(range(10)) + [1])
    assert cache[0] is not again[0] and mx.array_equal(again[0][1], mx.full((1, 2, 4, 4), 6.0)).item()


def test_a_state_is_not_stored_under_fewer_tokens_than_it_has_seen():
    pc = PrefixCache(1 << 20)
    pc.store(list(range(8)), state_and_kv(10, 5.0))  # the state saw 10 tokens; only 8 are known
    assert len(pc) == 0
    pc.store(list(range(12)), state_and_kv(10, 5.0))  # prompt + generated: the last 2 were never fed
    assert pc.lookup(list(range(12)))[1] == 10


def test_a_sliding_window_cache_is_reused_only_whole():
    pc = PrefixCache(1 << 20)
    rotating = RotatingKVCache(max_size=4)
    x = mx.arange(10, dtype=mx.float32)[None, None, :, None] * mx.ones((1, 2, 10, 4))
    rotating.update_and_fetch(x, x)
    pc.store(list(range(20, 30)), [rotating])
    assert pc.lookup(list(range(20, 27)) + [0, 0]) == (None, 0)
    cache, n = pc.lookup(list(range(20, 30)) + [0])
    assert n == 10 and cache[0].offset == 10 and cache[0] is not rotating


def test_entries_are_kept_under_tokens_the_cache_holds():
    pc = PrefixCache(1 << 20)
    pc.store(list(range(12)), kv(10))  # prompt + generated: the last tokens were never fed
    cache, n = pc.lookup(list(range(12)))
    assert n == 10 and pc.nbytes == 10 * BYTES_PER_TOKEN


def test_the_least_recently_used_entries_go_first_within_max_bytes():
    pc = PrefixCache(25 * BYTES_PER_TOKEN)
    a, b, c = ([k] * 10 for k in (1, 2, 3))
    pc.store(a, kv(10))
    pc.store(b, kv(10))
    pc.lookup(a + [0])  # a is used: b is now the oldest
    pc.store(a, kv(10))  # storing a known prefix again changes nothing
    assert pc.nbytes == 20 * BYTES_PER_TOKEN
    pc.store(c, kv(10))
    assert len(pc) == 2 and pc.nbytes == 20 * BYTES_PER_TOKEN
    assert pc.lookup(b + [0]) == (None, 0) and pc.lookup(a + [0])[1] == 10 and pc.lookup(c + [0])[1] == 10
    pc.store(list(range(30)), kv(30))  # larger than the whole budget: not stored, nothing evicted
    assert len(pc) == 2


def test_a_scope_sees_only_its_own_entries_under_one_byte_bound():
    """A pipeline stage scopes entries by the identity that released them: another identity's KV under the
    same tokens is never a match (issue 21, finding 2), while every scope shares the one byte bound."""
    pc = PrefixCache(BYTES_PER_TOKEN * 15)
    pc.store(list(range(10)), kv(10, start=500), scope="mallory")
    assert pc.lookup(list(range(10)) + [7], scope="alice") == (None, 0)
    assert pc.lookup(list(range(10)) + [7]) == (None, 0)  # the unscoped (single node) view too
    cache, n = pc.lookup(list(range(10)) + [7], scope="mallory")
    assert n == 10 and positions(cache) == [500.0 + i for i in range(10)]
    pc.store(list(range(10)), kv(10), scope="alice")  # the same tokens, another scope: its own entry
    cache, n = pc.lookup(list(range(10)) + [7], scope="alice")
    assert n == 10 and positions(cache) == list(range(10))
    assert len(pc) == 1 and pc.nbytes <= pc.max_bytes  # one bound: mallory's older entry was evicted
