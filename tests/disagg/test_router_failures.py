"""A real router over stand-in members (real sockets, the real handshake): what a node's CANCELLED and a
forged late HANDED_OFF do to a request whose client is still there (docs/disagg.md §6, §7.1).

Two prefill members and one decode member hold the secret; the test decides every message the router gets.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from mlxcel.cluster.identity import PeerId
from mlxcel.cluster.secret import load_secret
from mlxcel.disagg import messages as m
from mlxcel.disagg.wire import MAX_DISPATCH_ATTEMPTS, MsgType
from mlxcel.engine.interface import FinishEvent, TokenEvent
from mlxcel.config import DEFAULT_MAX_RESUMES as MAX_RESUMES
from mlxcel.error_codes import ErrorCode
from mlxcel.models.identity import model_identity
from tests.disagg.cluster import RoleNode, wait_for
from tests.disagg.members import Member
from tests.pipeline.cluster import free_port, write_secret

pytestmark = pytest.mark.proc  # starts processes (tests/proc_marker.py)

ROUTER_IP, P0_IP, P1_IP, DECODE_IP = (f"127.0.0.{i}" for i in range(60, 64))


def addr(ip: str) -> str:
    return f"{ip}:{free_port(ip)}"


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_llama):
    secret_file = write_secret(tmp_path_factory.mktemp("router-failures"))
    secret, model = load_secret(secret_file), model_identity(tiny_llama)
    p0, p1, decode, router = (addr(ip) for ip in (P0_IP, P1_IP, DECODE_IP, ROUTER_IP))
    members = [Member(p0, secret, "prefill", model), Member(p1, secret, "prefill", model),
               Member(decode, secret, "decode", model)]
    node = None
    try:
        node = RoleNode(tiny_llama, "router", ROUTER_IP, router, secret_file, "--prefill-peers", f"{p0},{p1}",
                        "--decode-peers", decode, "--probe-interval", "0.3")
        node.wait_ready()
        yield node, members[:2], members[2], PeerId.parse(router)
    finally:
        if node is not None:
            node.stop()
        for member in members:
            member.close()


def metrics(node: RoleNode) -> dict:
    return httpx.get(f"{node.url}/router/stats", timeout=5).json()["metrics"]


class Client:
    """One completion request on its own thread."""

    def __init__(self, node: RoleNode, max_tokens: int):
        self.answer: dict = {}
        body = {"model": "tiny", "prompt": "hi", "max_tokens": max_tokens}
        self.thread = threading.Thread(target=lambda: self.answer.setdefault(
            "r", httpx.post(f"{node.url}/v1/completions", json=body, timeout=60)))
        self.thread.start()

    def reply(self) -> httpx.Response:
        self.thread.join(60)
        return self.answer["r"]


def next_generate(prefills: list[Member], seen: int) -> tuple[Member, dict]:
    """The GENERATE after the first ``seen`` any prefill member got (in arrival order), and who got it."""
    def find():
        got = sorted(((p, doc) for p in prefills for doc in p.of(MsgType.GENERATE)), key=lambda pd: pd[1]["_at"])
        return got[seen] if len(got) > seen else None
    return wait_for(find, what="a GENERATE")


def generates(prefills: list[Member]) -> int:
    return sum(len(p.of(MsgType.GENERATE)) for p in prefills)


def tokens(nonce: str, *ids: int) -> bytes:
    return m.Tokens(nonce, tuple(TokenEvent(i, f" t{i}") for i in ids)).encode()


def finish(nonce: str, done: int) -> bytes:
    return m.Finish(nonce, FinishEvent("length", "", 1, done)).encode()


@pytest.mark.parametrize("how", ["error", "finish"])
def test_a_nodes_cancelled_after_the_first_token_is_resumed_not_answered_499(setup, how):
    """The decode node ends the attempt with CANCELLED (an ERROR, or a FINISH carrying the code) after 2 tokens
    while the client is still there: a node failure like any other, resumed from the 2 tokens relayed."""
    node, prefills, decode, router = setup
    before, seen = metrics(node), generates(prefills)
    client = Client(node, 4)
    _, gen = next_generate(prefills, seen)
    decode.send(router, tokens(gen["nonce"], 7, 8))
    wait_for(lambda: metrics(node)["router_requests"] > before["router_requests"], what="the request")
    cancelled = (m.Error(gen["nonce"], ErrorCode.CANCELLED, "the node cancelled it").encode() if how == "error" else
                 m.Finish(gen["nonce"], FinishEvent("error", "", 1, 2, "the node cancelled it",
                                                    ErrorCode.CANCELLED)).encode())
    time.sleep(0.2)  # the two tokens reach the router first (one connection: in order anyway)
    decode.send(router, cancelled)
    _, resumed = next_generate(prefills, seen + 1)
    assert resumed["draws"] == 2 and resumed["prompt"][-2:] == [7, 8] and resumed["params"]["max_tokens"] == 2
    decode.send(router, tokens(resumed["nonce"], 9, 10))
    decode.send(router, finish(resumed["nonce"], 2))
    reply = client.reply()
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 4
    after = metrics(node)
    assert after["router_failed"] == before["router_failed"]
    assert after["router_cancelled"] == before["router_cancelled"]
    assert after["router_resumed"] == before["router_resumed"] + 1
    assert after["router_completed"] == before["router_completed"] + 1


def test_a_nodes_cancelled_before_the_first_token_fails_over_then_ends_500(setup):
    """Before any token a node's CANCELLED fails over to other nodes (then is resumed, as any failure whose
    attempts are spent); once those are spent too the request ends as the router's failure (500), never 499,
    and counts in router_failed, not router_cancelled."""
    node, prefills, _, router = setup
    before, seen = metrics(node), generates(prefills)
    client = Client(node, 2)
    sent = 0
    while client.thread.is_alive() and sent < MAX_DISPATCH_ATTEMPTS + MAX_RESUMES:
        member, gen = next_generate(prefills, seen + sent)
        assert gen.get("draws", 0) == 0 and len(gen["prompt"]) == len(prefills[0].of(MsgType.GENERATE)[0]["prompt"])
        member.send(router, m.Error(gen["nonce"], ErrorCode.CANCELLED, "the node cancelled it").encode())
        sent += 1
    reply = client.reply()
    assert reply.status_code == 500, reply.text
    assert "Retry-After" not in reply.headers and "cancelled the request on its own" in reply.text
    time.sleep(0.3)
    assert generates(prefills) == seen + MAX_DISPATCH_ATTEMPTS + MAX_RESUMES  # nothing after the answer
    after = metrics(node)
    assert after["router_failed"] == before["router_failed"] + 1
    assert after["router_cancelled"] == before["router_cancelled"]
    assert after["router_failovers"] == before["router_failovers"] + MAX_DISPATCH_ATTEMPTS - 1


def test_a_late_handed_off_from_an_unassigned_prefill_node_neither_counts_nor_hides_the_real_one(setup):
    """Another configured prefill node sends a HANDED_OFF for an ended request first: dropped (counted, logged);
    the assigned prefill node's late HANDED_OFF 0.25 s later still counts, once."""
    node, prefills, decode, router = setup
    before, seen = metrics(node), generates(prefills)
    client = Client(node, 1)
    assigned, gen = next_generate(prefills, seen)
    other = next(p for p in prefills if p is not assigned)
    nonce = gen["nonce"]
    decode.send(router, tokens(nonce, 5))
    decode.send(router, finish(nonce, 1))
    assert client.reply().status_code == 200
    other.send(router, m.HandedOff(nonce, 999, 0.5, decode="forged").encode())
    wait_for(lambda: metrics(node)["router_dropped_frames"] > before["router_dropped_frames"], what="the drop")
    time.sleep(0.25)
    real = m.HandedOff(nonce, 4096, 0.01, decode="decode-0").encode()
    assigned.send(router, real)
    after = wait_for(lambda: (s := metrics(node))["router_handoffs"] > before["router_handoffs"] and s,
                     what="the real late handoff counted")
    assert after["router_handoff_bytes"] == before["router_handoff_bytes"] + 4096
    assert after["router_dropped_frames"] == before["router_dropped_frames"] + 1
    assigned.send(router, real)  # a replay counts nothing
    time.sleep(0.5)
    final = metrics(node)
    assert final["router_handoffs"] == before["router_handoffs"] + 1
    assert final["router_handoff_bytes"] == after["router_handoff_bytes"]
    line = next(line for line in node.lines if "a HANDED_OFF for a request it was not assigned" in line)
    assert str(other.bind) in line
