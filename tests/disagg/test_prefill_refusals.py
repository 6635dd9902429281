"""A prefill service in this process, on real sockets: refusals happen before any prefill work."""

from __future__ import annotations

import time

import pytest

from mlxcel.cluster.identity import PeerId
from mlxcel.cluster.secret import ClusterSecret
from mlxcel.cluster.transport import Transport
from mlxcel.cluster.wire import Kind
from mlxcel.disagg import messages as m
from mlxcel.disagg.allowlist import Allowlist
from mlxcel.disagg.flags import NodeConfig
from mlxcel.disagg.prefill import PrefillService
from mlxcel.disagg.wire import MsgType
from mlxcel.engine.sampling import SamplingParams
from mlxcel.error_codes import ErrorCode
from tests.pipeline.cluster import free_port

pytestmark = pytest.mark.proc  # starts processes (tests/proc_marker.py)

SECRET = ClusterSecret(b"prefill-refusal-tests-secret-0123456789")
PREFILL_IP, ROUTER_IP, DECODE_IP = "127.0.0.60", "127.0.0.61", "127.0.0.62"


def recorder(ip: str) -> tuple[Transport, list]:
    """A secret holder recording control messages decoded and stream parts as (kind, bytes)."""
    got: list = []
    t = Transport(f"{ip}:0", SECRET)
    t.serve(on_message=lambda msg: got.append(m.decode(msg.payload) if msg.kind is Kind.CONTROL
                                              else (msg.kind, bytes(msg.payload))))
    return t, got


def wait_for(predicate, timeout: float = 10):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError("timed out")


@pytest.fixture
def nodes():
    router, replies = recorder(ROUTER_IP)
    decode, received = recorder(DECODE_IP)
    yield router, replies, decode, received
    router.close()
    decode.close()


class Unrebuildable:
    """A cache class with neither from_state nor a state setter: no record kind carries it."""

    state = ()


def service(path, decode: Transport, allowlist: Allowlist | None = None, uncarried: bool = False) -> PrefillService:
    from mlxcel.models.loading import load_checkpoint

    loaded = load_checkpoint(path)
    if uncarried:  # a model whose layer 0 keeps a cache no handoff carries
        loaded.model.make_cache = lambda: [Unrebuildable() for _ in loaded.model.layers]
    cfg = NodeConfig("prefill", PeerId.of(PREFILL_IP, free_port(PREFILL_IP)), (), (decode.identity,))
    svc = PrefillService(cfg, loaded.model, loaded.tokenizer, secret=SECRET, identity="x", context_length=2048, parallel=2,
                         max_batch_size=2, max_queue=2, warmup=False, allowlist=allowlist or Allowlist(None))
    svc.start()
    return svc


def generate(nonce: str, target: PeerId | None = None) -> bytes:
    return m.Generate(nonce, (1, 40, 41, 42), SamplingParams(max_tokens=3), decode_target=target).encode()


def test_a_model_whose_cache_cannot_travel_is_refused_per_request_and_the_node_keeps_serving(tiny_llama, nodes):
    router, replies, decode, received = nodes
    svc = service(tiny_llama, decode, uncarried=True)
    try:
        for nonce in ("000000000000000a", "000000000000000b"):
            router.send(svc.transport.identity, Kind.CONTROL, generate(nonce))
        wait_for(lambda: len(replies) == 2)
        for kind, doc in replies:
            assert kind is MsgType.ERROR and doc["code"] == ErrorCode.UNSUPPORTED
            assert "cannot be handed off to a decode node" in doc["message"] and "layer 0" in doc["message"]
            assert "keeps a Unrebuildable" in doc["message"]
        assert svc.scheduler.counters.prompt_tokens == 0  # no prefill work at all
        state = m.decode(router.request(svc.transport.identity, m.encode(MsgType.STATE, {})))[1]
        assert state["role"] == "prefill" and state["cache_supported"] is False and state["refused"] == 2
        assert received == [] and decode.authenticated_connections == 0
    finally:
        svc.close()


def test_checks_run_in_order_before_prefill(tiny_llama, nodes):
    router, replies, decode, received = nodes
    svc = service(tiny_llama, decode, Allowlist(frozenset({decode.identity})))
    dead = PeerId.of(DECODE_IP, free_port(DECODE_IP))
    try:
        svc.allowlist = Allowlist(frozenset({decode.identity, dead}))
        router.send(svc.transport.identity, Kind.CONTROL, generate("00000000000000c1", PeerId.parse("127.0.0.63:1")))
        router.send(svc.transport.identity, Kind.CONTROL, generate("00000000000000c2", dead))  # allowed, nobody there
        router.send(svc.transport.identity, Kind.CONTROL, b"\x01{\"nonce\": \"00000000000000c3\", \"prompt\": []}")
        wait_for(lambda: len(replies) == 3)
        by_nonce = {doc["nonce"]: doc for _, doc in replies}
        assert by_nonce["00000000000000c1"]["code"] == ErrorCode.UNAUTHORIZED
        assert by_nonce["00000000000000c2"]["code"] == ErrorCode.UNREACHABLE
        assert by_nonce["00000000000000c2"]["node"] == str(dead)
        assert by_nonce["00000000000000c3"]["code"] == ErrorCode.BAD_REQUEST
        assert svc.scheduler.counters.prompt_tokens == 0
        router.send(svc.transport.identity, Kind.CONTROL, generate("00000000000000c4"))  # the fallback target
        wait_for(lambda: len(replies) == 5)
        assert [kind for kind, _ in received][-1] is Kind.STREAM_END and len(received) >= 3  # header, chunks, end
        # the first token early (docs/disagg.md §3.1): one TOKENS event, then HANDED_OFF
        assert [kind for kind, _ in replies[3:]] == [MsgType.TOKENS, MsgType.HANDED_OFF]
        assert len(replies[3][1]["events"]) == 1 and replies[3][1]["nonce"] == "00000000000000c4"
        assert replies[-1][1]["decode"] == str(decode.identity)
        assert svc.scheduler.counters.prompt_tokens == 4
    finally:
        svc.close()
