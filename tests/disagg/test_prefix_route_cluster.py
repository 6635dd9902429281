"""Prefix-aware routing on a real cluster (docs/disagg.md §6, "Prefix-aware selection"): a router over two
prefill nodes and one decode node sends each conversation's later turns to the prefill node that prefilled
its first, whose prefix cache then serves them; a second router over the same nodes with
``--route-policy round-robin`` alternates."""

from __future__ import annotations

import random

import httpx
import pytest

from tests.disagg.cluster import DisaggCluster, RoleNode
from tests.pipeline.cluster import free_port

pytestmark = pytest.mark.proc  # starts processes (tests/proc_marker.py)

RR_HOST = "127.0.0.26"
TURNS = (140, 210, 280)  # each turn's prompt: the earlier turn's and some more tokens (2, 3 and 4 blocks of 64)


@pytest.fixture(scope="module")
def routers(tmp_path_factory, tiny_llama):
    c = DisaggCluster(tmp_path_factory.mktemp("prefix-route"), tiny_llama, prefills=2, decodes=1).start()
    rr = None
    try:
        rr = RoleNode(tiny_llama, "router", RR_HOST, f"{RR_HOST}:{free_port(RR_HOST)}", c.secret,
                      "--prefill-peers", ",".join(c.prefill_addrs), "--decode-peers", c.decode_addrs[0],
                      "--probe-interval", "0.3", "--route-policy", "round-robin")
        rr.wait_ready()
        yield c, rr
    finally:
        if rr is not None:
            rr.stop()
        c.stop()


def router_stats(url: str) -> dict:
    return httpx.get(f"{url}/router/stats", timeout=5).json()


def dispatched(url: str) -> dict[str, int]:
    return {n["id"]: n["dispatched"] for n in router_stats(url)["nodes"] if n["role"] == "prefill"}


def turn(url: str, prompt: list[int]) -> str:
    """One completion; the prefill node it went to."""
    before = dispatched(url)
    r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1}, timeout=120)
    assert r.status_code == 200, r.text
    after = dispatched(url)
    [node] = [n for n in after if after[n] != before[n]]
    return node


def conversations(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 200) for _ in range(TURNS[-1])] for _ in range(2)]


def prefix_hits(c: DisaggCluster) -> int:
    return sum(node.state()["prefix_hits"] for node in c.prefills)


def test_a_conversation_stays_on_its_prefill_node_and_hits_its_cache_while_round_robin_alternates(routers):
    c, rr = routers
    hits = prefix_hits(c)
    nodes = [[turn(c.url, conv[:n]) for n in TURNS] for conv in conversations(1)]
    assert all(len(set(turns)) == 1 for turns in nodes), nodes  # turns 2 and 3 where turn 1 went
    assert nodes[0][0] != nodes[1][0]  # the second conversation went to the idle node
    metrics = router_stats(c.url)["metrics"]
    assert metrics["router_prefix_hits"] == 4 and metrics["router_prefix_misses"] == 2
    assert metrics["router_prefix_tokens"] == 2 * (2 + 3) * 64  # turn 2 matched 2 blocks, turn 3 three
    assert prefix_hits(c) - hits >= 4  # the prefill nodes' own caches served turns 2 and 3
    blocks = {n["id"]: n["prefix_blocks"] for n in router_stats(c.url)["nodes"] if n["role"] == "prefill"}
    assert blocks == {"prefill-0": 4, "prefill-1": 4}

    rr_nodes = [[turn(rr.url, conv[:n]) for n in TURNS] for conv in conversations(2)]
    assert all(turns[0] != turns[1] for turns in rr_nodes), rr_nodes  # round-robin: turn 2 on the other node
    rr_metrics = router_stats(rr.url)["metrics"]
    assert rr_metrics["router_prefix_hits"] == rr_metrics["router_prefix_misses"] == 0
    assert "prefix_blocks" not in router_stats(rr.url)["nodes"][0]
