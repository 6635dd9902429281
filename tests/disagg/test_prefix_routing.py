"""Prefix-aware choice of a prefill node on plain data (docs/disagg.md §6, "Prefix-aware selection")."""

from __future__ import annotations

import random
import sys

import pytest

from mlxcel.disagg.policy import NoneUp, Route, RoutePolicy
from mlxcel.disagg.prefix_routing import BLOCK_TOKENS, PrefixIndex, PromptKey, new_key

KEY = b"k" * 32
P = ("p0", "p1", "p2")


def everyone(node: str) -> bool:
    return True


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(n)]


def key(toks: list[int]) -> PromptKey:
    return PromptKey.of(toks, KEY)


def policy(max_blocks: int = 1024, slack: int = 2) -> RoutePolicy[str]:
    return RoutePolicy(P, ("d0",), prefix=PrefixIndex(max_blocks), slack=slack)


# -- hashes ----------------------------------------------------------------------------------------------


def test_a_block_hash_names_the_whole_prefix_and_a_partial_block_is_not_hashed():
    a = tokens(1, 3 * BLOCK_TOKENS + 10)
    k = key(a)
    assert len(k.blocks) == 3 and len(set(k.blocks)) == 3
    assert key(a[:2 * BLOCK_TOKENS]).blocks == k.blocks[:2]  # a growing conversation shares its blocks
    b = [a[0] + 1] + a[1:]  # the first token differs: every block's hash differs (chained)
    assert not set(key(b).blocks) & set(k.blocks)
    assert key(a[:BLOCK_TOKENS - 1]).blocks == ()


def test_hashes_are_keyed_per_router():
    a = tokens(2, 2 * BLOCK_TOKENS)
    assert PromptKey.of(a, new_key()).blocks != PromptKey.of(a, new_key()).blocks
    assert PromptKey.of(a, KEY) == PromptKey.of(a, KEY)


# -- the index -------------------------------------------------------------------------------------------


def test_the_index_is_bounded_per_node_under_a_flood_of_distinct_prompts():
    index: PrefixIndex[str] = PrefixIndex(max_blocks=100)
    for i in range(500):
        index.learn("p0", key(tokens(i, 4 * BLOCK_TOKENS)))
    assert index.size("p0") == 100 and index.size("p1") == 0
    latest = key(tokens(499, 4 * BLOCK_TOKENS))
    assert index.match("p0", latest) == 4  # the most recent prompts are kept
    assert index.match("p0", key(tokens(0, 4 * BLOCK_TOKENS))) == 0  # the oldest went
    huge = key(tokens(9, 300 * BLOCK_TOKENS))
    index.learn("p1", huge)  # one prompt longer than the bound keeps its first blocks
    assert index.size("p1") == 100 and index.match("p1", huge) == 100
    assert sys.getsizeof(index._nodes["p0"]) < 64 * 1024


def test_eviction_drops_the_deepest_blocks_of_a_prompt_first():
    index: PrefixIndex[str] = PrefixIndex(max_blocks=6)
    old, new = key(tokens(1, 4 * BLOCK_TOKENS)), key(tokens(2, 4 * BLOCK_TOKENS))
    index.learn("p0", old)
    index.learn("p0", new)  # 8 blocks into 6: two of the old prompt's go, its last two
    assert index.match("p0", old) == 2 and index.match("p0", new) == 4


def test_a_bound_below_one_block_is_refused():
    with pytest.raises(ValueError, match="at least 1 block"):
        PrefixIndex(0)


# -- the pick ----------------------------------------------------------------------------------------------


def test_the_longest_prefix_wins():
    p = policy()
    conv = tokens(3, 6 * BLOCK_TOKENS)
    p.prefix.learn("p1", key(conv[:2 * BLOCK_TOKENS]))
    p.prefix.learn("p2", key(conv[:4 * BLOCK_TOKENS]))
    assert p.pick(everyone, key(conv)) == Route("p2", "d0", 4)
    assert p.pick(everyone, key(conv)) == Route("p2", "d0", 4)  # sticky: the index does not move
    assert p.pick(lambda n: n != "p2", key(conv)) == Route("p1", "d0", 2)  # p2 down: the next longest


def test_no_match_goes_to_the_least_loaded_then_round_robin():
    p = policy()
    loads = {"p0": 1, "p1": 0, "p2": 0}
    got = [p.pick(everyone, key(tokens(10 + i, BLOCK_TOKENS)), loads.__getitem__).prefill for i in range(4)]
    assert got == ["p1", "p2", "p1", "p2"]
    assert [p.pick(everyone, key(tokens(20 + i, 10))).prefill for i in range(3)] == ["p0", "p1", "p2"]


def test_a_matching_node_is_preferred_only_within_the_load_bound():
    p = policy(slack=2)
    conv = tokens(4, 3 * BLOCK_TOKENS)
    p.prefix.learn("p0", key(conv))
    assert p.pick(everyone, key(conv), {"p0": 2, "p1": 0, "p2": 0}.__getitem__).prefill == "p0"
    over = p.pick(everyone, key(conv), {"p0": 3, "p1": 0, "p2": 1}.__getitem__)
    assert over == Route("p1", "d0", 0)  # p0 is more than 2 above the least loaded: least loaded wins


def test_a_member_holding_every_prefix_draws_no_more_than_the_load_bound():
    """A node the index credits with every conversation (as a liar that handed off everything would be)
    gets new requests only while it is at most ``slack`` above the least-loaded node."""
    p = policy(slack=2)
    convs = [tokens(100 + i, 2 * BLOCK_TOKENS) for i in range(30)]
    for c in convs:
        p.prefix.learn("p0", key(c))
    load = {n: 0 for n in P}
    for c in convs:  # 30 requests in flight at once, none finishing
        load[p.pick(everyone, key(c), load.__getitem__).prefill] += 1
    assert load["p0"] - min(load["p1"], load["p2"]) <= 3 and load["p0"] <= 12


def test_a_down_or_restarted_node_is_forgotten_and_a_failed_prompt_dropped():
    p = policy()
    conv = tokens(5, 2 * BLOCK_TOKENS)
    p.prefix.learn("p1", key(conv))
    p.prefix.forget("p1")
    assert p.prefix.size("p1") == 0 and p.pick(everyone, key(conv)).matched == 0
    p.prefix.learn("p2", key(conv))
    p.prefix.learn("p2", key(tokens(6, 2 * BLOCK_TOKENS)))
    p.prefix.unlearn("p2", key(conv))
    assert p.prefix.match("p2", key(conv)) == 0 and p.prefix.size("p2") == 2


def test_no_prefill_node_up_is_none_up_and_round_robin_ignores_keys():
    assert policy().pick(lambda n: n == "d0", key(tokens(7, BLOCK_TOKENS))) == NoneUp("prefill")
    rr = RoutePolicy(P, ("d0",))
    conv = tokens(8, 2 * BLOCK_TOKENS)
    assert [rr.pick(everyone, key(conv)).prefill for _ in range(3)] == ["p0", "p1", "p2"]
