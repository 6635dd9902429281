"""A real router process over members played by this test on real sockets (docs/disagg.md §3, §6, §8).

The prefill and decode "nodes" are transports holding the secret that answer the router's STATE probes,
so the test decides every message the router receives; one more configured prefill address holds
another secret and one is never there at all.
"""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import httpx
import pytest

from mlxcel.cluster.identity import PeerId
from mlxcel.cluster.secret import ClusterSecret, load_secret
from mlxcel.cluster.wire import Kind
from mlxcel.disagg import messages as m
from mlxcel.disagg.wire import MsgType
from mlxcel.engine.interface import FinishEvent, TokenEvent
from mlxcel.models.identity import model_identity
from tests.disagg.cluster import RoleNode, wait_for
from tests.disagg.members import Member
from tests.pipeline.cluster import free_port, write_secret

pytestmark = pytest.mark.proc  # starts processes (tests/proc_marker.py)

DOC = Path(__file__).resolve().parents[2] / "docs" / "disagg.md"
ROUTER_IP, PREFILL_IP, WRONG_IP, ABSENT_IP, DECODE_IP = (f"127.0.0.{i}" for i in range(40, 45))


def addr(ip: str) -> str:
    return f"{ip}:{free_port(ip)}"


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_llama):
    tmp = tmp_path_factory.mktemp("router-members")
    secret_file = write_secret(tmp)
    secret, model = load_secret(secret_file), model_identity(tiny_llama)
    ips = (PREFILL_IP, WRONG_IP, ABSENT_IP, DECODE_IP, ROUTER_IP)
    prefill, wrong, absent, decode, router = (addr(ip) for ip in ips)
    members = [Member(prefill, secret, "prefill", model),
               Member(wrong, ClusterSecret(b"another-cluster-secret-0123456789"), "prefill", model),
               Member(decode, secret, "decode", model)]
    node = None
    try:
        node = RoleNode(tiny_llama, "router", ROUTER_IP, router, secret_file, "--prefill-peers",
                        f"{prefill},{wrong},{absent}", "--decode-peers", decode, "--probe-interval", "0.3",
                        env={"MLXCEL_ROUTER_STATS_VERBOSE": "1"})
        node.wait_ready()
        yield node, members[0], members[2], PeerId.parse(router)
    finally:
        if node is not None:
            node.stop()
        for member in members:
            member.close()



def stats(node: RoleNode) -> dict:
    return httpx.get(f"{node.url}/router/stats", timeout=5).json()


def documented_metrics() -> list[str]:
    section = DOC.read_text().split("## 8. Observability", 1)[1].split("\n## ", 1)[0]
    return sorted(set(re.findall(r'"(router_\w+)"', section)))


def test_every_router_metric_the_docs_list_is_a_gauge_on_metrics(setup):
    node, *_ = setup
    names = documented_metrics()
    assert len(names) == 26
    assert sorted(stats(node)["metrics"]) == names  # the docs list exactly what /router/stats reports
    body = httpx.get(f"{node.url}/metrics", timeout=5).text
    missing = [n for n in names if not re.search(rf"^# TYPE {n} gauge$", body, re.M)]
    assert not missing, f"not gauges on /metrics: {missing}"
    assert re.search(r"^router_decode_up 1\.0$", body, re.M) and re.search(r"^router_prefill_up 1\.0$", body, re.M)


def test_a_member_with_another_secret_is_logged_as_a_secret_mismatch(setup):
    node, *_ = setup
    wait_for(lambda: "(secret mismatch)" in "".join(node.lines), what="the secret mismatch in the router's log")
    line = next(line for line in node.lines if "(secret mismatch)" in line)
    assert "prefill-1" in line and "is down" in line


def test_verbose_stats_give_a_down_reason_to_nodes_that_were_never_up(setup):
    node, *_ = setup
    nodes = {n["id"]: n for n in wait_for(lambda: stats(node)["nodes"] if all(
        n.get("down_reason") for n in stats(node)["nodes"] if n["status"] == "down") else None, what="down reasons")}
    assert nodes["prefill-0"]["status"] == "up" and "down_reason" not in nodes["prefill-0"]
    assert nodes["prefill-1"]["status"] == "down" and "(secret mismatch)" in nodes["prefill-1"]["down_reason"]
    assert nodes["prefill-2"]["status"] == "down" and nodes["prefill-2"]["down_reason"]
    assert sum(1 for line in node.lines if "prefill-2 (prefill node) is down" in line) == 1  # once, not per probe


def test_an_error_whose_code_is_not_a_json_integer_is_dropped(setup):
    node, prefill, _, router = setup
    before = stats(node)["metrics"]["router_dropped_frames"]
    answer: dict = {}

    def ask() -> None:
        answer["r"] = httpx.post(f"{node.url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2},
                                 timeout=30)

    client = threading.Thread(target=ask)
    client.start()
    try:
        [gen] = wait_for(lambda: prefill.of(MsgType.GENERATE), what="the GENERATE")
        nonce = gen["nonce"]
        for bad in ({}, {"code": 1.0}, {"code": True}, {"code": "6"}, {"code": None}):
            doc = {"nonce": nonce, "message": "bad code", **bad}
            prefill.transport.send(router, Kind.CONTROL, m.encode(MsgType.ERROR, doc))
        wait_for(lambda: stats(node)["metrics"]["router_dropped_frames"] >= before + 5, what="five drops")
        assert len(prefill.of(MsgType.GENERATE)) == 1 and "r" not in answer  # no failover, the request waits
        valid = {"nonce": nonce, "code": 2, "message": "a bad field"}
        prefill.transport.send(router, Kind.CONTROL, m.encode(MsgType.ERROR, valid))
    finally:
        client.join(30)
    assert answer["r"].status_code == 400 and "a bad field" in answer["r"].text
    assert "code must be" in "".join(node.lines)


def _answered_by_members(node: RoleNode, prefill: Member, decode: Member, router: PeerId, *,
                         late: list[bytes]) -> tuple[httpx.Response, str]:
    """A completion the members answer: the decode member streams one token and FINISH; then the prefill
    member sends ``late`` (frames for the ended attempt)."""
    seen = len(prefill.of(MsgType.GENERATE))
    answer: dict = {}
    client = threading.Thread(target=lambda: answer.setdefault("r", httpx.post(
        f"{node.url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 1}, timeout=30)))
    client.start()
    try:
        gen = wait_for(lambda: prefill.of(MsgType.GENERATE)[seen:], what="the GENERATE")[0]
        nonce = gen["nonce"]
        decode.transport.send(router, Kind.CONTROL, m.Tokens(nonce, (TokenEvent(5, " x"),)).encode())
        decode.transport.send(router, Kind.CONTROL, m.Finish(nonce, FinishEvent("length", "", 1, 1)).encode())
        client.join(30)
        for payload in late:
            prefill.transport.send(router, Kind.CONTROL, payload.replace(b"NONCE", nonce.encode()))
    finally:
        client.join(30)
    return answer["r"], nonce


def test_a_handed_off_that_comes_after_the_finish_still_counts_the_handoff(setup):
    """HANDED_OFF (prefill -> router) and FINISH (decode -> router) travel on different connections: the
    handoff of an attempt that already ended still counts, once, and only from that attempt's prefill node."""
    node, prefill, decode, router = setup
    before = stats(node)["metrics"]
    handed = m.HandedOff("NONCE", 4096, 0.01, decode="decode-0").encode()
    reply, _ = _answered_by_members(node, prefill, decode, router, late=[handed, handed])
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == " x"
    after = wait_for(lambda: (s := stats(node)["metrics"])["router_handoffs"] > before["router_handoffs"] and s,
                     what="the late handoff counted")
    assert after["router_handoffs"] == before["router_handoffs"] + 1  # the replayed one is not counted again
    assert after["router_handoff_bytes"] == before["router_handoff_bytes"] + 4096
    # from the decode node (not the attempt's prefill node), a late HANDED_OFF counts nothing
    reply, _ = _answered_by_members(node, prefill, decode, router, late=[])
    nonce = next(doc["nonce"] for doc in reversed(prefill.of(MsgType.GENERATE)))
    decode.transport.send(router, Kind.CONTROL, m.HandedOff(nonce, 4096, 0.01).encode())
    time.sleep(0.5)
    assert stats(node)["metrics"]["router_handoffs"] == after["router_handoffs"]
