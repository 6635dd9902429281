"""A router, a prefill node and two decode nodes started through the real CLI on 127.0.0.x.

The tests run in file order on one cluster; the failure tests at the end kill and restart nodes.
"""

from __future__ import annotations

import json
import re
import signal
import threading
import time

import httpx
import numpy as np
import openai
import pytest

from mlxcel.cluster.identity import PeerId
from mlxcel.cluster.secret import load_secret
from mlxcel.cluster.transport import Transport
from mlxcel.cluster.wire import Kind
from mlxcel.disagg import messages as m
from mlxcel.disagg.kv_codec import KVLayout, LayerSpec, encode_chunks, encode_header
from mlxcel.disagg.wire import CacheKind, DType, MsgType
from mlxcel.engine.interface import FinishEvent, TokenEvent
from mlxcel.engine.sampling import SamplingParams
from mlxcel.error_codes import ErrorCode
from tests.disagg.cluster import DECODE_HOSTS, PREFILL_HOSTS, DisaggCluster, RoleNode, wait_for
from tests.server.util import ServerProcess, metrics

pytestmark = pytest.mark.proc  # starts processes (tests/proc_marker.py)

STEP_DELAY = "0.03"  # decode nodes sleep this long per step, so requests stay in flight while we act
FORGER_IP, FAKE_ROUTER_IP, EXFIL_IP = "127.0.0.30", "127.0.0.31", "127.0.0.32"
CHATS = ["Hello there", "The capital of France is", "Write one short sentence about the sea, please."]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_llama):
    c = DisaggCluster(tmp_path_factory.mktemp("disagg"), tiny_llama, prefills=2, decodes=2,
                      prefill_flags=("--log-level", "debug"), decode_env={"MLXCEL_TEST_DECODE_STEP_DELAY_S": STEP_DELAY})
    c.prefill_env = {"MLXCEL_DECODE_ALLOWLIST": f"{c.decode_addrs[0]}, decode.lan:1,{c.decode_addrs[1]}",
                     "MLXCEL_HANDOFF_LANES": "2", "MLXCEL_HANDOFF_SPLIT_MIN_BYTES": "1"}  # every handoff split
    c.start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def single(tiny_llama):
    server = ServerProcess(tiny_llama, "--node-role", "hybrid", "--no-warmup")
    server.wait_ready()
    yield server
    server.stop()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def chat(url: str, text: str, **kw) -> openai.types.chat.ChatCompletion:
    return client(url).chat.completions.create(model="tiny", messages=[{"role": "user", "content": text}], **kw)


def streamed(url: str, text: str, **kw) -> tuple[str, str | None]:
    out, finish = [], None
    for chunk in client(url).chat.completions.create(model="tiny", messages=[{"role": "user", "content": text}],
                                                     stream=True, **kw):
        if chunk.choices:
            out.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    return "".join(out), finish


def secret_of(c: DisaggCluster):
    return load_secret(c.secret)


def listener(ip: str, c: DisaggCluster) -> tuple[Transport, list]:
    """A secret holder on ``ip`` that records every message it receives."""
    got: list = []
    t = Transport(f"{ip}:0", secret_of(c), max_reconnect_attempts=1, reconnect_budget=0)
    t.serve(on_message=lambda msg: got.append((msg.peer, msg.kind, bytes(msg.payload), msg.id, msg.status)))
    return t, got



def control(got: list, kind: MsgType) -> list[dict]:
    return [m.decode(p)[1] for _, k, p, _, _ in got if k is Kind.CONTROL and m.decode(p)[0] is kind]


# -- serving ------------------------------------------------------------------------------------------


def test_greedy_text_equals_a_single_node_streamed_and_not(cluster, single):
    for text in CHATS:
        ref = chat(single.url, text, max_tokens=16, temperature=0)
        got = chat(cluster.url, text, max_tokens=16, temperature=0)
        assert got.choices[0].message.content == ref.choices[0].message.content
        assert got.choices[0].finish_reason == ref.choices[0].finish_reason
        assert got.usage.completion_tokens == ref.usage.completion_tokens == 16
        assert got.usage.prompt_tokens == ref.usage.prompt_tokens
        assert streamed(cluster.url, text, max_tokens=16, temperature=0) == (ref.choices[0].message.content, "length")


def test_seeded_sampling_and_logprobs_continue_across_the_handoff(cluster, single):
    kw = dict(max_tokens=12, temperature=0.9, seed=1234, logprobs=True, top_logprobs=3)
    ref, got = chat(single.url, CHATS[1], **kw), chat(cluster.url, CHATS[1], **kw)
    assert got.choices[0].message.content == ref.choices[0].message.content
    ref_lp = [(t.token, t.logprob, [a.token for a in t.top_logprobs]) for t in ref.choices[0].logprobs.content]
    got_lp = [(t.token, t.logprob, [a.token for a in t.top_logprobs]) for t in got.choices[0].logprobs.content]
    assert [x[0] for x in got_lp] == [x[0] for x in ref_lp] and [x[2] for x in got_lp] == [x[2] for x in ref_lp]
    assert np.allclose([x[1] for x in got_lp], [x[1] for x in ref_lp], atol=1e-4)
    text = client(cluster.url).completions.create(model="tiny", prompt="abc", max_tokens=5, temperature=0)
    assert text.choices[0].text == client(single.url).completions.create(model="tiny", prompt="abc", max_tokens=5,
                                                                         temperature=0).choices[0].text


def test_penalties_and_logit_bias_hold_across_the_handoff(cluster, single):
    """The prefill node samples the first token with them, the decode node the rest with the window rebuilt
    from the handoff's prompt and first token: the single node's text, streamed or not."""
    from tests.engine.penalty_reference import PENALIZED

    extra = {k: v for k, v in PENALIZED.items() if k != "repetition_penalty"}
    kw = dict(max_tokens=16, temperature=0, extra_body={"repetition_penalty": PENALIZED["repetition_penalty"]}, **extra)
    for text in CHATS[:2]:
        ref = chat(single.url, text, **kw).choices[0].message.content
        assert chat(cluster.url, text, **kw).choices[0].message.content == ref
        assert streamed(cluster.url, text, **kw)[0] == ref
        assert ref != chat(single.url, text, max_tokens=16, temperature=0).choices[0].message.content


def test_two_decode_nodes_share_the_load_and_stats_are_redacted(cluster):
    before = {n["id"]: n["dispatched"] for n in cluster.stats()["nodes"]}
    for i in range(4):
        chat(cluster.url, f"request {i}", max_tokens=2, temperature=0)
    raw = httpx.get(f"{cluster.url}/router/stats", timeout=5).text
    stats = json.loads(raw)
    after = {n["id"]: n["dispatched"] for n in stats["nodes"]}
    assert after["decode-0"] - before["decode-0"] == after["decode-1"] - before["decode-1"] == 2
    assert after["prefill-0"] - before["prefill-0"] == after["prefill-1"] - before["prefill-1"] == 2
    assert stats["addresses_redacted"] is True and "127.0.0." not in raw
    assert {n["id"]: (n["role"], n["status"]) for n in stats["nodes"]} == {
        "prefill-0": ("prefill", "up"), "prefill-1": ("prefill", "up"), "decode-0": ("decode", "up"),
        "decode-1": ("decode", "up")}
    metrics = stats["metrics"]
    assert metrics["router_handoffs"] >= 4 and metrics["router_handoff_bytes"] > 0
    assert metrics["router_handoff_seconds"] > 0


def test_concurrent_handoffs_over_two_lanes_give_a_single_node_s_text(cluster, single):
    texts = [f"{CHATS[i % 3]} ({i})" for i in range(8)]
    refs = [chat(single.url, t, max_tokens=6, temperature=0).choices[0].message.content for t in texts]
    before = [p.state() for p in cluster.prefills]
    got: dict[int, str] = {}

    def one(i: int) -> None:
        got[i] = chat(cluster.url, texts[i], max_tokens=6, temperature=0).choices[0].message.content

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(texts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [got.get(i) for i in range(len(texts))] == refs
    after = [p.state() for p in cluster.prefills]
    assert all(len(s["handoff_lanes"]) == 2 for s in after)  # MLXCEL_HANDOFF_LANES=2
    for b, a in zip(before, after):  # every handoff counted on one lane
        assert sum(a["handoff_lanes"]) - sum(b["handoff_lanes"]) == a["handoffs"] - b["handoffs"]
    assert sum(a["handoffs"] - b["handoffs"] for b, a in zip(before, after)) == len(texts)
    # MLXCEL_HANDOFF_SPLIT_MIN_BYTES=1: each handoff split over both lanes (docs/disagg.md §4.9)
    assert sum(a["split_handoffs"] - b["split_handoffs"] for b, a in zip(before, after)) == len(texts)
    assert all(d.state()["connections"] >= 1 for d in cluster.decodes)
    # the GIL changes hands every 0.5 ms in both roles (mlxcel/threads.py), so handoff threads are not starved
    assert {n.state()["switch_interval_ms"] for n in [*cluster.prefills, *cluster.decodes]} == {0.5}


def test_a_keyed_router_guards_every_endpoint_but_health_and_verbose_stats_show_addresses(cluster, tiny_llama):
    keys = cluster.tmp / "api.keys"
    keys.write_text("router-test-key-0123456789\n")
    keys.chmod(0o600)
    router = RoleNode(tiny_llama, "router", "127.0.0.26", f"127.0.0.26:{_free('127.0.0.26')}", cluster.secret,
                      "--prefill-peers", ",".join(cluster.prefill_addrs), "--decode-peers",
                      ",".join(cluster.decode_addrs), "--api-key-file", str(keys),
                      env={"MLXCEL_ROUTER_STATS_VERBOSE": "Yes"})
    try:
        router.wait_ready()
        for path in ("/router/stats", "/v1/models"):
            assert httpx.get(f"{router.url}{path}", timeout=5).status_code == 401
        auth = {"Authorization": "Bearer router-test-key-0123456789"}
        stats = httpx.get(f"{router.url}/router/stats", headers=auth, timeout=5).json()
        assert stats["addresses_redacted"] is False
        assert [n["address"] for n in stats["nodes"]] == [*cluster.prefill_addrs, *cluster.decode_addrs]
        api = openai.OpenAI(base_url=f"{router.url}/v1", api_key="router-test-key-0123456789", max_retries=0)
        got = api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "k"}], max_tokens=2)
        assert got.usage.completion_tokens == 2
    finally:
        router.stop()


def _free(host: str) -> int:
    from tests.pipeline.cluster import free_port

    return free_port(host)


# -- security -------------------------------------------------------------------------------------------


class _InFlight:
    """A greedy stream of CHATS[2] through the router, read until its first text: its nonce (from the prefill
    nodes' debug log) and the decode node it is assigned to are known, and a resume (not a fail-over) follows
    a failure."""

    KW = dict(max_tokens=120, temperature=0)  # about 4 s of decoding: in flight while a test acts

    def __init__(self, cluster: DisaggCluster):
        seen = [len(p.lines) for p in cluster.prefills]
        stream = client(cluster.url).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": CHATS[2]}], stream=True, **self.KW)
        self.chunks = iter(stream)
        self.parts: list[str] = []
        while not "".join(self.parts):  # a token reached the client (the first chunk may carry the role only)
            self.parts += [c.delta.content or "" for c in next(self.chunks).choices]
        self.nonce = wait_for(lambda: _nonce([line for p, n in zip(cluster.prefills, seen) for line in p.lines[n:]]),
                              what="the request's nonce")
        busy = wait_for(lambda: [n["id"] for n in cluster.stats()["nodes"] if n["role"] == "decode" and n["in_flight"]])
        self.busy = int(busy[0][-1])

    def text(self) -> str:
        self.parts += [c.choices[0].delta.content or "" for c in self.chunks if c.choices]
        return "".join(self.parts)


def _posing(cluster: DisaggCluster, decode: int) -> Transport:
    """A secret holder on a configured decode node's IP and port, sending only."""
    return Transport(f"{DECODE_HOSTS[decode]}:{PeerId.parse(cluster.decode_addrs[decode]).port}", secret_of(cluster))


def test_forged_result_frames_are_dropped(cluster, single):
    ref = chat(single.url, CHATS[2], **_InFlight.KW).choices[0].message.content
    flight = _InFlight(cluster)
    forged = [m.Tokens(flight.nonce, (TokenEvent(5, " FORGED"),)).encode(),
              m.Finish(flight.nonce, FinishEvent("stop", " FORGED")).encode()]
    outsider, _ = listener(FORGER_IP, cluster)  # holds the secret, is no configured peer
    posing = _posing(cluster, 1 - flight.busy)  # the idle decode node: not assigned this request
    try:
        for t in (outsider, posing):
            for payload in forged:
                t.send(PeerId.parse(cluster.router_addr), Kind.CONTROL, payload)
        text = flight.text()
    finally:
        outsider.close()
        posing.close()
    assert text == ref and "FORGED" not in text
    log = "".join(cluster.router.lines)
    assert f"router: dropping result frame from {FORGER_IP}:" in log
    assert "a TOKENS for a request it was not assigned" in log and "a FINISH for a request it was not assigned" in log
    assert cluster.stats()["metrics"]["router_dropped_frames"] >= 4


@pytest.mark.parametrize("where", ["token", "top_logprobs"])
def test_a_token_id_outside_the_vocabulary_from_the_assigned_decode_node_is_resumed_not_relayed(
        cluster, single, where):
    """The assigned decode node (a member holding the secret) streams an id no model samples: the router
    relays none of it, fails the attempt and resumes it, so the client still gets the undisturbed text."""
    ref = chat(single.url, CHATS[2], **_InFlight.KW).choices[0].message.content
    resumed = cluster.stats()["metrics"]["router_resumed"]
    flight = _InFlight(cluster)
    event = TokenEvent(320, " FORGED") if where == "token" else TokenEvent(5, " FORGED", -0.1, ((2**32 - 1, -0.2),))
    posing = _posing(cluster, flight.busy)
    try:
        posing.send(PeerId.parse(cluster.router_addr), Kind.CONTROL, m.Tokens(flight.nonce, (event,)).encode())
        text = flight.text()
    finally:
        posing.close()
    assert text == ref and "FORGED" not in text
    log = "".join(cluster.router.lines)
    assert "out of range [0, 320)" in log
    assert cluster.stats()["metrics"]["router_resumed"] == resumed + 1, log[-3000:]


def _nonce(lines: list[str]) -> str | None:
    for line in lines:
        found = re.search(r"prefill: request ([0-9a-f]{16}) from", line)
        if found:
            return found.group(1)
    return None


def test_a_decode_target_outside_the_allowlist_is_refused_before_connecting(cluster):
    prefill = PeerId.parse(cluster.prefill_addrs[0])
    fake, got = listener(FAKE_ROUTER_IP, cluster)
    exfil, stolen = listener(EXFIL_IP, cluster)
    before = cluster.prefills[0].state()
    try:
        gen = m.Generate("00000000000000aa", (1, 40, 41, 42), SamplingParams(max_tokens=3), decode_target=exfil.identity)
        fake.send(prefill, Kind.CONTROL, gen.encode())
        [error] = wait_for(lambda: control(got, MsgType.ERROR), what="the refusal")
        assert error["code"] == ErrorCode.UNAUTHORIZED and "MLXCEL_DECODE_ALLOWLIST" in error["message"]
        time.sleep(0.3)
        assert stolen == [] and exfil.authenticated_connections == 0  # not even a connection was made
        after = cluster.prefills[0].state()
        assert after["handoffs"] == before["handoffs"] and after["refused"] == before["refused"] + 1
        # an allowlisted target named on the wire works, and its results go to the router that asked
        ok = m.Generate("00000000000000ab", (1, 40, 41, 42), SamplingParams(max_tokens=3), ignore_eos=True,
                        decode_target=PeerId.parse(cluster.decode_addrs[1]))
        fake.send(prefill, Kind.CONTROL, ok.encode())
        [finish] = wait_for(lambda: control(got, MsgType.FINISH), what="the finish")
        assert finish["completion_tokens"] == 3 and len(control(got, MsgType.HANDED_OFF)) == 1
    finally:
        fake.close()
        exfil.close()
    log = "".join(cluster.prefills[0].lines)
    assert "MLXCEL_DECODE_ALLOWLIST: skipping 'decode.lan:1'" in log


def test_kv_frames_that_break_the_bounds_are_refused_without_allocation(cluster, tiny_llama):
    decode = PeerId.parse(cluster.decode_addrs[0])
    forger, got = listener(FORGER_IP, cluster)
    layout = KVLayout(tuple(LayerSpec(CacheKind.KV, DType.FLOAT32, 2, 16, 16) for _ in range(4)))
    meta = m.HandoffMeta("00000000000000cc", forger.identity, SamplingParams(max_tokens=2),
                         TokenEvent(5, "")).doc()
    before = cluster.decodes[0].state()
    attacks = [
        [encode_header(meta, tuple(range(5000)), layout)],  # longer than the 2048-token context
        [encode_header(meta, (1, 2, 3), KVLayout(layout.layers[:3]))],  # 3 layers for a 4-layer model
        [encode_header(meta, (1, 2, 3), KVLayout((LayerSpec(CacheKind.KV, DType.FLOAT16, 2, 16, 16),) * 4))],
        [encode_header(meta, tuple(i % 256 for i in range(2000)), layout),  # a big claim, then more bytes than it
         *list(encode_chunks([np.zeros(layout.nbytes(2000) + 8, np.uint8)], 1 << 20))[:-1]],
        [encode_header(meta, (1, 2, 3), layout), *list(encode_chunks([np.zeros(100, np.uint8)], 50))],  # cut short
    ]
    try:
        for parts in attacks:
            with forger.open_stream(decode) as s:
                for p in parts:
                    s.write(p)
        errors = wait_for(lambda: len(control(got, MsgType.ERROR)) == len(attacks) and control(got, MsgType.ERROR),
                          what="five refusals")
    finally:
        forger.close()
    assert {e["code"] for e in errors} == {ErrorCode.BAD_TENSOR}
    texts = " | ".join(e["message"] for e in errors)
    for words in ("5000 prompt tokens", "names 3 layers", "float16", "more than the header's", "100 of 3072 tensor bytes"):
        assert words in texts
    after = cluster.decodes[0].state()
    assert after["refused"] == before["refused"] + len(attacks)
    assert after["incoming"] == 0 and after["incoming_bytes"] == 0 and after["kv_sequences"] == 0
    assert chat(cluster.url, "still serving", max_tokens=3, temperature=0).usage.completion_tokens == 3


def test_a_client_disconnect_frees_the_kv_on_both_nodes(cluster):
    before = sum(d.state()["cancelled"] for d in cluster.decodes)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "go on"}], "max_tokens": 400,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{cluster.url}/v1/chat/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]  # a few tokens: the sequence decodes on a decode node
        assert all(line.startswith("data:") or not line for line in got)
        assert sum(d.state()["kv_sequences"] for d in cluster.decodes) == 1
    # a non-streaming request whose client gives up
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{cluster.url}/v1/chat/completions", json={**body, "stream": False}, timeout=1.0)

    def freed() -> bool:
        states = [n.state() for n in (*cluster.decodes, *cluster.prefills)]
        return all(s["kv_sequences"] == 0 and s["sequences"] == 0 for s in states) and all(
            s.get("incoming", 0) == 0 for s in states)

    wait_for(freed, what="the KV to be freed")
    assert sum(d.state()["cancelled"] for d in cluster.decodes) >= before + 2
    assert cluster.stats()["metrics"]["router_cancelled"] >= 2


# -- failures -------------------------------------------------------------------------------------------


def test_a_killed_decode_node_s_requests_are_resumed_on_the_other_and_it_is_skipped(cluster, single):
    """Two greedy and two seeded streams, one of each on each decode node; decode-0 is killed mid-stream:
    its two are resumed on decode-1 (prompt + tokens prefilled again, docs/disagg.md §6.1) and every
    stream equals a single node's, token for token, the seeded ones included (their sampler goes on)."""
    kws = [dict(temperature=0), dict(temperature=0), dict(temperature=0.9, seed=77), dict(temperature=0.9, seed=78)]
    expected = {i: streamed(single.url, f"long story {i}", max_tokens=120, **kw) for i, kw in enumerate(kws)}
    results: dict[int, object] = {}
    resumed = cluster.stats()["metrics"]["router_resumed"]

    def run(i: int) -> None:
        try:
            results[i] = streamed(cluster.url, f"long story {i}", max_tokens=120, **kws[i])
        except openai.APIError as exc:
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
        time.sleep(0.1)
    wait_for(lambda: all(n["in_flight"] == 2 for n in cluster.stats()["nodes"] if n["role"] == "decode"),
             what="two requests on each decode node")
    time.sleep(0.5)  # some tokens streamed
    cluster.decodes[0].kill()
    for t in threads:
        t.join(90)
    assert results == expected
    assert cluster.stats()["metrics"]["router_resumed"] == resumed + 2
    assert metrics(cluster.url)["mlxcel_resumed_requests_total"] == resumed + 2
    cluster.wait_status("decode-0", "down")
    before = {n["id"]: n["dispatched"] for n in cluster.stats()["nodes"]}
    for i in range(3):
        assert chat(cluster.url, f"after {i}", max_tokens=2, temperature=0).usage.completion_tokens == 2
    after = {n["id"]: n["dispatched"] for n in cluster.stats()["nodes"]}
    assert after["decode-0"] == before["decode-0"] and after["decode-1"] == before["decode-1"] + 3
    cluster.decodes[0].restart()
    cluster.wait_status("decode-0", "up")
    for i in range(2):
        chat(cluster.url, f"back {i}", max_tokens=2, temperature=0)
    assert cluster.stats()["nodes"][2]["dispatched"] > after["decode-0"]


def test_a_dead_prefill_node_is_skipped_and_no_request_fails(cluster):
    cluster.prefills[1].kill()
    for i in range(4):  # at once: a send to the dead node (if the probe has not noticed yet) fails over
        assert chat(cluster.url, f"prefill gone {i}", max_tokens=2, temperature=0).usage.completion_tokens == 2
    assert cluster.node_status("prefill-1") == "down"
    before = {n["id"]: n["dispatched"] for n in cluster.stats()["nodes"]}
    for i in range(3):
        chat(cluster.url, f"still {i}", max_tokens=2, temperature=0)
    after = {n["id"]: n["dispatched"] for n in cluster.stats()["nodes"]}
    assert after["prefill-1"] == before["prefill-1"] and after["prefill-0"] == before["prefill-0"] + 3
    cluster.prefills[1].restart()
    cluster.wait_status("prefill-1", "up")


def test_with_every_decode_node_down_requests_are_held_and_go_on_when_one_is_back(cluster):
    """No decode node up: new requests are held (docs/disagg.md §6.2), streamed or not, while /v1/models answers
    and /health says 503; once a decode node is back they complete (the 503 after --resume-timeout and the
    hold bound: tests/disagg/test_router_holding.py)."""
    for node in cluster.decodes:
        node.kill()
    for i in range(len(cluster.decodes)):
        cluster.wait_status(f"decode-{i}", "down")
    before = cluster.stats()["metrics"]
    replies: dict = {}
    held = [threading.Thread(target=lambda: replies.update(plain=chat(cluster.url, "hi", max_tokens=2, temperature=0))),
            threading.Thread(target=lambda: replies.update(streamed=streamed(cluster.url, "hi", max_tokens=2,
                                                                               temperature=0)))]
    for thread in held:
        thread.start()
    wait_for(lambda: cluster.stats()["metrics"]["router_held"] == 2, what="two requests held")
    models = httpx.get(f"{cluster.url}/v1/models", timeout=5)
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "tiny"
    health = httpx.get(f"{cluster.url}/health", timeout=5)
    assert health.status_code == 503 and health.json()["decode_up"] == 0
    cluster.decodes[1].restart()
    for thread in held:
        thread.join(60)
    assert replies["plain"].usage.completion_tokens == 2 and replies["streamed"][0]
    after = cluster.stats()["metrics"]
    assert after["router_holds"] == before["router_holds"] + 2 and after["router_held"] == 0
    assert after["router_unavailable"] == before["router_unavailable"]
    cluster.wait_status("decode-1", "up")
    assert chat(cluster.url, "hi again", max_tokens=2, temperature=0).usage.completion_tokens == 2


def test_the_first_token_reaches_the_client_while_every_decode_node_is_stopped(cluster, single):
    """The prefill node sends the first token to the router before the KV travels (docs/disagg.md §3.1): with
    every decode node stopped (SIGSTOP), the router relays it at once; resumed, the decode node goes on and the
    client's text is a single node's, the first token once."""
    ref = chat(single.url, CHATS[2], max_tokens=12, temperature=0)
    assert ref.usage.completion_tokens >= 2  # the first token is no EOS: it is sent early
    for _ in range(4):  # every prefill node has dialled every decode node (a stopped one cannot handshake)
        chat(cluster.url, CHATS[0], max_tokens=1)
    before = cluster.stats()["metrics"]["router_early_first"]
    got: dict = {}
    request = threading.Thread(target=lambda: got.update(reply=chat(cluster.url, CHATS[2], max_tokens=12,
                                                                     temperature=0)))
    stopped = [n.proc for n in cluster.decodes]
    for proc in stopped:
        proc.send_signal(signal.SIGSTOP)
    try:
        request.start()
        wait_for(lambda: cluster.stats()["metrics"]["router_early_first"] > before, timeout=15,
                 what="the first token relayed while the decode nodes are stopped")
    finally:
        for proc in stopped:
            proc.send_signal(signal.SIGCONT)
    request.join(60)
    assert got["reply"].choices[0].message.content == ref.choices[0].message.content
    assert got["reply"].usage.completion_tokens == ref.usage.completion_tokens


def test_a_prefill_node_may_send_only_its_attempt_s_first_token(cluster, single):
    """A secret holder posing as the request's prefill node (its IP and port) sends TOKENS mid-stream: a
    second first token and a two-event message are both dropped and counted, and the client's text is
    untouched. (The warning's text is not asserted: the router-drop warnings' budget of 5 a minute is the
    forged-frame tests'.)"""
    ref = chat(single.url, CHATS[2], **_InFlight.KW).choices[0].message.content
    dropped = cluster.stats()["metrics"]["router_dropped_frames"]
    flight = _InFlight(cluster)
    which = next(i for i, p in enumerate(cluster.prefills) if flight.nonce in "".join(p.lines))
    posing = Transport(f"{PREFILL_HOSTS[which]}:{PeerId.parse(cluster.prefill_addrs[which]).port}", secret_of(cluster))
    try:
        for events in ((TokenEvent(5, " FORGED"),), (TokenEvent(5, " FORGED"), TokenEvent(6, " TWICE"))):
            posing.send(PeerId.parse(cluster.router_addr), Kind.CONTROL, m.Tokens(flight.nonce, events).encode())
        text = flight.text()
    finally:
        posing.close()
    assert text == ref and "FORGED" not in text
    assert cluster.stats()["metrics"]["router_dropped_frames"] >= dropped + 2


def test_a_json_schema_holds_across_the_handoff(cluster, single):
    """The prefill node samples the first token under the grammar, the decode node the rest after replaying
    it (the handoff's ``generated``): the single node's valid JSON, streamed or not."""
    import json

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "ok": {"type": "boolean"}}, "required": ["n", "ok"],
              "additionalProperties": False}
    extra = {"response_format": {"type": "json_schema", "json_schema": {"name": "o", "schema": schema}}}
    kw = dict(max_tokens=24, temperature=0, extra_body=extra)
    ref = chat(single.url, CHATS[0], **kw)
    assert ref.choices[0].finish_reason == "stop" and set(json.loads(ref.choices[0].message.content)) == {"n", "ok"}
    assert chat(cluster.url, CHATS[0], **kw).choices[0].message.content == ref.choices[0].message.content
    assert streamed(cluster.url, CHATS[0], **kw)[0] == ref.choices[0].message.content
