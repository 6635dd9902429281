"""Prefix-aware routing against a lying member (docs/disagg.md §6, "Prefix-aware selection"; §7.1).

A real router process over two prefill members and one decode member played by this test on real sockets
(the real handshake). The liar (prefill-0) claims in its STATE to hold every prefix, forges a HANDED_OFF
for a request of the other prefill node, fails what it was expected to hold, and sits on requests it was
given: its claims change no entry of the index, its forgery changes no entry of the other node's, a failure
drops its entry, and the load bound sends requests past it to the other node. A node that goes down is
forgotten.
"""

from __future__ import annotations

import random
import threading

import httpx
import pytest

from mlxcel.cluster.identity import PeerId
from mlxcel.cluster.secret import load_secret
from mlxcel.cluster.wire import Kind
from mlxcel.disagg import messages as m
from mlxcel.disagg.wire import MsgType
from mlxcel.engine.interface import FinishEvent, TokenEvent
from mlxcel.error_codes import ErrorCode
from mlxcel.models.identity import model_identity
from tests.disagg.cluster import RoleNode, wait_for
from tests.disagg.members import Member
from tests.pipeline.cluster import free_port, write_secret

pytestmark = pytest.mark.proc  # starts processes (tests/proc_marker.py)

ROUTER_IP, LIAR_IP, HONEST_IP, DECODE_IP = (f"127.0.0.{i}" for i in range(46, 50))
BLOCKS = 3


def addr(ip: str) -> str:
    return f"{ip}:{free_port(ip)}"


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_llama):
    tmp = tmp_path_factory.mktemp("prefix-members")
    secret_file = write_secret(tmp)
    secret, model = load_secret(secret_file), model_identity(tiny_llama)
    liar, honest, decode, router = (addr(ip) for ip in (LIAR_IP, HONEST_IP, DECODE_IP, ROUTER_IP))
    members = [Member(liar, secret, "prefill", model), Member(honest, secret, "prefill", model),
               Member(decode, secret, "decode", model)]
    members[0].state = m.state_doc(role="prefill", boot_id="00" * 8, model=model, ready=True, prefix_hits=10**9,
                                   prefix_blocks=10**9, prefix_tokens=10**12)  # claims to hold everything
    node = None
    try:
        node = RoleNode(tiny_llama, "router", ROUTER_IP, router, secret_file, "--prefill-peers", f"{liar},{honest}",
                        "--decode-peers", decode, "--probe-interval", "0.3", "--handoff-timeout", "30")
        node.wait_ready()
        yield node, *members, PeerId.parse(router)
    finally:
        if node is not None:
            node.stop()
        for member in members:
            member.close()


def stats(node: RoleNode) -> dict:
    return httpx.get(f"{node.url}/router/stats", timeout=5).json()


def blocks(node: RoleNode) -> dict[str, int]:
    return {n["id"]: n["prefix_blocks"] for n in stats(node)["nodes"] if n["role"] == "prefill"}


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 200) for _ in range(BLOCKS * 64 + 5)]


class Ask:
    """A completion in a thread: ``join`` gives its response (or the exception, such as a client timeout)."""

    def __init__(self, node: RoleNode, tokens: list[int], timeout: float = 60):
        self.result: object = None
        body = {"model": "tiny", "prompt": tokens, "max_tokens": 1}

        def run() -> None:
            try:
                self.result = httpx.post(f"{node.url}/v1/completions", json=body, timeout=timeout)
            except httpx.HTTPError as exc:
                self.result = exc

        self.thread = threading.Thread(target=run)
        self.thread.start()

    def join(self) -> object:
        self.thread.join(90)
        return self.result


def generate(member: Member, seen: int) -> dict:
    return wait_for(lambda: member.of(MsgType.GENERATE)[seen:], what=f"a GENERATE to {member.bind}")[0]


def answer(prefill: Member, decode: Member, router: PeerId, nonce: str) -> None:
    """The prefill member hands off, the decode member streams one token and finishes."""
    prefill.send(router, m.HandedOff(nonce, 4096, 0.01, decode="decode-0").encode())
    decode.send(router, m.Tokens(nonce, (TokenEvent(5, " x"),)).encode())
    decode.send(router, m.Finish(nonce, FinishEvent("length", "", len(prompt(0)), 1)).encode())


def served(node: RoleNode, prefill: Member, decode: Member, router: PeerId, tokens: list[int]) -> None:
    """A completion ``prefill`` (which must get it) and ``decode`` answer."""
    seen = len(prefill.of(MsgType.GENERATE))
    ask = Ask(node, tokens)
    answer(prefill, decode, router, generate(prefill, seen)["nonce"])
    assert ask.join().status_code == 200


def test_a_lying_member_cannot_write_another_s_entries_nor_hold_traffic_it_fails_or_sits_on(setup):
    node, liar, honest, decode, router = setup
    x, y = prompt(1), prompt(2)
    assert blocks(node) == {"prefill-0": 0, "prefill-1": 0}  # STATE's claims are not read into the index

    served(node, liar, decode, router, x)  # a tie goes round-robin: prefill-0 first
    assert blocks(node) == {"prefill-0": BLOCKS, "prefill-1": 0}

    # y goes to the honest node; the liar forges a HANDED_OFF for it: dropped, no entry moves
    dropped = stats(node)["metrics"]["router_dropped_frames"]
    seen = len(honest.of(MsgType.GENERATE))
    ask = Ask(node, y)
    nonce = generate(honest, seen)["nonce"]
    liar.send(router, m.HandedOff(nonce, 4096, 0.01, decode="decode-0").encode())
    wait_for(lambda: stats(node)["metrics"]["router_dropped_frames"] > dropped, what="the forged HANDED_OFF dropped")
    assert blocks(node) == {"prefill-0": BLOCKS, "prefill-1": 0}
    answer(honest, decode, router, nonce)
    assert ask.join().status_code == 200
    assert blocks(node) == {"prefill-0": BLOCKS, "prefill-1": BLOCKS}
    served(node, honest, decode, router, y)  # y's next turn: where y was prefilled, not to the liar

    # x again: expected on the liar, which fails it; the entry goes and the failover serves it elsewhere
    seen = len(liar.of(MsgType.GENERATE)), len(honest.of(MsgType.GENERATE))
    ask = Ask(node, x)
    bad = generate(liar, seen[0])["nonce"]
    liar.send(router, m.Error(bad, ErrorCode.INTERNAL, "lost it").encode())
    answer(honest, decode, router, generate(honest, seen[1])["nonce"])
    assert ask.join().status_code == 200
    assert blocks(node)["prefill-0"] == 0 and blocks(node)["prefill-1"] == 2 * BLOCKS
    served(node, honest, decode, router, x)  # from now on x is the honest node's

    # the liar holds z and sits on every request: the load bound (2 above the least loaded) sends the 4th away
    z = prompt(3)
    served(node, liar, decode, router, z)  # no match: least loaded, then round-robin (the liar's turn)
    assert blocks(node)["prefill-0"] == BLOCKS  # z is the liar's
    seen = len(liar.of(MsgType.GENERATE)), len(honest.of(MsgType.GENERATE))
    stuck = [Ask(node, z, timeout=4) for _ in range(3)]
    wait_for(lambda: len(liar.of(MsgType.GENERATE)) == seen[0] + 3, what="three GENERATEs to the liar")
    fourth = Ask(node, z)
    answer(honest, decode, router, generate(honest, seen[1])["nonce"])
    assert fourth.join().status_code == 200
    assert all(isinstance(a.join(), httpx.TimeoutException) for a in stuck)  # clients gave up: cancelled
    assert len(liar.of(MsgType.GENERATE)) == seen[0] + 3
    metrics = stats(node)["metrics"]
    assert (metrics["router_prefix_hits"], metrics["router_prefix_misses"]) == (6, 4)  # the failover is not a pick

    # a node that goes down is forgotten whole (its cache is gone); the other keeps its entries
    honest.close()
    wait_for(lambda: blocks(node)["prefill-1"] == 0, what="the down node's entries forgotten")
    assert blocks(node)["prefill-0"] == BLOCKS
