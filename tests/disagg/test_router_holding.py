"""A real router whose only prefill node stops and comes back (stand-in members, real sockets, the real
handshake): new requests are held, not refused, while no node of a role is up (docs/disagg.md §6.2)."""

from __future__ import annotations

import re
import threading
import time

import httpx
import pytest

from mlxcel.cluster.identity import PeerId
from mlxcel.cluster.secret import load_secret
from mlxcel.disagg import messages as m
from mlxcel.disagg.wire import MsgType
from mlxcel.engine.interface import FinishEvent, TokenEvent
from mlxcel.models.identity import model_identity
from tests.disagg.cluster import RoleNode, wait_for
from tests.disagg.members import Member
from tests.pipeline.cluster import free_port, write_secret

pytestmark = pytest.mark.proc  # starts processes (tests/proc_marker.py)

ROUTER_IP, PREFILL_IP, DECODE_IP = "127.0.0.65", "127.0.0.66", "127.0.0.67"
BUDGET_S, HOLD_LIMIT = 3.0, 2  # the router's --resume-timeout and --max-queue


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_llama):
    secret_file = write_secret(tmp_path_factory.mktemp("router-holding"))
    secret, model = load_secret(secret_file), model_identity(tiny_llama)
    prefill, decode, router = (f"{ip}:{free_port(ip)}" for ip in (PREFILL_IP, DECODE_IP, ROUTER_IP))
    members = {"prefill": Member(prefill, secret, "prefill", model), "decode": Member(decode, secret, "decode", model)}
    node = None
    try:
        node = RoleNode(tiny_llama, "router", ROUTER_IP, router, secret_file, "--prefill-peers", prefill,
                        "--decode-peers", decode, "--probe-interval", "0.2", "--resume-timeout", str(BUDGET_S),
                        "--max-queue", str(HOLD_LIMIT))
        node.wait_ready()
        yield node, members, PeerId.parse(router)
    finally:
        if node is not None:
            node.stop()
        for member in members.values():
            member.close()


def metrics(node: RoleNode) -> dict:
    return httpx.get(f"{node.url}/router/stats", timeout=5).json()["metrics"]


def prometheus(node: RoleNode, name: str) -> float:
    body = httpx.get(f"{node.url}/metrics", timeout=5).text
    return float(re.search(rf"^{name} (\S+)$", body, re.M).group(1))


def stop_prefill(node: RoleNode, members: dict) -> None:
    members["prefill"].close()
    wait_for(lambda: metrics(node)["router_prefill_up"] == 0, what="the prefill node down")


def start_prefill(members: dict) -> Member:
    old = members["prefill"]
    members["prefill"] = Member(old.bind, old.secret, "prefill", old.model)
    return members["prefill"]


class Client:
    """One completion on its own thread; ``seconds`` is how long its answer took."""

    def __init__(self, node: RoleNode, *, stream: bool = False):
        self.answer: dict = {}
        self.stream = stream
        self.thread = threading.Thread(target=self._run, args=(node,))
        self.thread.start()

    def _run(self, node: RoleNode) -> None:
        started = time.monotonic()
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 1, "stream": self.stream}
        self.answer["r"] = httpx.post(f"{node.url}/v1/completions", json=body, timeout=60)
        self.answer["seconds"] = time.monotonic() - started

    def reply(self) -> tuple[httpx.Response, float]:
        self.thread.join(60)
        return self.answer["r"], self.answer["seconds"]


def test_a_request_is_held_while_the_only_prefill_node_is_down_and_runs_when_it_is_back(setup):
    node, members, router = setup
    stop_prefill(node, members)
    before = metrics(node)
    client = Client(node)
    wait_for(lambda: metrics(node)["router_held"] == 1, what="the request held")
    assert prometheus(node, "mlxcel_held_requests") == 1
    time.sleep(1.0)
    assert client.thread.is_alive()  # held, not refused
    prefill = start_prefill(members)
    [gen] = wait_for(lambda: prefill.of(MsgType.GENERATE), what="the held request dispatched")
    decode = members["decode"]
    decode.send(router, m.Tokens(gen["nonce"], (TokenEvent(5, " x"),)).encode())
    decode.send(router, m.Finish(gen["nonce"], FinishEvent("length", "", 1, 1)).encode())
    reply, seconds = client.reply()
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == " x"
    assert 1.0 <= seconds < BUDGET_S
    after = metrics(node)
    assert after["router_held"] == 0 and after["router_holds"] == before["router_holds"] + 1
    assert after["router_unavailable"] == before["router_unavailable"]
    assert after["router_hold_failed"] == before["router_hold_failed"]
    assert prometheus(node, "mlxcel_requests_held_total") == after["router_holds"]
    assert any("holding new requests until a prefill and a decode node are up" in line for line in node.lines)


def test_held_requests_are_bounded_released_by_their_client_and_end_503_after_the_budget(setup):
    node, members, router = setup
    stop_prefill(node, members)
    before = metrics(node)
    with httpx.Client(timeout=60) as http:  # a streaming client that goes away while held
        with http.stream("POST", f"{node.url}/v1/completions",
                         json={"model": "tiny", "prompt": "hi", "max_tokens": 1, "stream": True}) as gone:
            wait_for(lambda: metrics(node)["router_held"] == 1, what="the streaming request held")
            waiting = Client(node)
            wait_for(lambda: metrics(node)["router_held"] == 2, what="two held")
            started = time.monotonic()
            refused = httpx.post(f"{node.url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 1},
                                 timeout=30)
            assert refused.status_code == 503 and time.monotonic() - started < 1.0  # the bound: at once
            assert refused.headers["Retry-After"] == "1" and "--max-queue" in refused.text
            assert gone.status_code == 200
    wait_for(lambda: metrics(node)["router_held"] == 1, what="the gone client's request released")
    assert metrics(node)["router_cancelled"] == before["router_cancelled"] + 1
    reply, seconds = waiting.reply()
    assert reply.status_code == 503 and reply.headers["Retry-After"] == "1"
    assert "no prefill node is up" in reply.text and "--resume-timeout" in reply.text
    assert seconds >= BUDGET_S
    after = metrics(node)
    assert after["router_held"] == 0 and after["router_holds"] == before["router_holds"] + 2
    assert after["router_hold_failed"] == before["router_hold_failed"] + 1
    assert after["router_unavailable"] == before["router_unavailable"] + 1  # the one refused at once
    assert prometheus(node, "mlxcel_hold_failed_requests_total") == after["router_hold_failed"]
    start_prefill(members)
    wait_for(lambda: metrics(node)["router_prefill_up"] == 1, what="the prefill node back")
