"""Token ids from the wire are bounded by the model's vocabulary before MLX sees them (issue 21).

A prefill and a decode node started through the real CLI on 127.0.0.x; this test is a cluster member
holding the secret that speaks to them directly, as a router would (GENERATE) and as a prefill node
would (KV handoff streams). Every refusal is an ERROR with its documented code to the router the
message names, the node keeps serving, and a valid request afterwards still works.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from mlxcel.cluster.identity import PeerId
from mlxcel.cluster.secret import load_secret
from mlxcel.cluster.transport import Transport
from mlxcel.cluster.wire import Kind
from mlxcel.config import MAX_TOKENS_LIMIT
from mlxcel.disagg import messages as m
from mlxcel.disagg.kv_codec import KVLayout, LayerSpec, encode_chunks, encode_header
from mlxcel.disagg.wire import CacheKind, DType, MsgType
from mlxcel.engine.sampling import SamplingParams
from mlxcel.error_codes import ErrorCode
from tests.disagg.cluster import FAST, RoleNode
from tests.pipeline.cluster import free_port, write_secret

pytestmark = pytest.mark.proc  # starts processes (tests/proc_marker.py)

VOCAB = 320  # tiny_llama's vocabulary
CONTEXT = 2048
PREFILL_IP, DECODE_IP, MEMBER_IP = "127.0.0.70", "127.0.0.71", "127.0.0.72"
LAYOUT = KVLayout(tuple(LayerSpec(CacheKind.KV, DType.FLOAT32, 2, 16, 16) for _ in range(4)))  # tiny_llama's KV
PROMPT = (1, 40, 41, 42)
PARAMS = m.params_doc(SamplingParams(max_tokens=1))
EDGES = (2**32 - 1, 2**32, 2**31, 2**31 - 1, VOCAB, VOCAB - 1, 600, 0, -1, -(2**31), 2**63, -(2**63))
ANY_INT = st.one_of(st.sampled_from(EDGES), st.integers(-(2**40), 2**40), st.integers(0, 2**32 - 1))
PROPERTY = settings(max_examples=20, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@dataclass
class Nodes:
    prefill: RoleNode
    decode: RoleNode
    member: Transport
    got: list  # (kind, document) of every control message the member received

    def answer(self, nonce: str, kinds: tuple[MsgType, ...], node: RoleNode, timeout: float = 30) -> tuple:
        """The first control message about ``nonce`` of one of ``kinds``; fails at once if ``node`` died."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for kind, doc in list(self.got):
                if doc.get("nonce") == nonce and kind in kinds:
                    return kind, doc
            rc = node.proc.poll()
            assert rc is None, f"{node.node_id} died (exit {rc}) on request {nonce}:\n" + "".join(node.lines[-20:])
            time.sleep(0.02)
        raise AssertionError(f"no {[k.name for k in kinds]} for {nonce} from {node.node_id}; got {self.got[-5:]}")


@pytest.fixture(scope="module")
def nodes(tmp_path_factory, tiny_llama):
    secret = write_secret(tmp_path_factory.mktemp("token-bounds"))
    decode_addr = f"{DECODE_IP}:{free_port(DECODE_IP)}"
    started: list[RoleNode] = []
    member = None
    try:
        started.append(RoleNode(tiny_llama, "decode", DECODE_IP, decode_addr, secret, *FAST))
        started.append(RoleNode(tiny_llama, "prefill", PREFILL_IP, f"{PREFILL_IP}:{free_port(PREFILL_IP)}", secret,
                                "--decode-peers", decode_addr, *FAST))
        for node in started:
            node.wait_ready()
        got: list = []
        member = Transport(f"{MEMBER_IP}:0", load_secret(secret), max_reconnect_attempts=1, reconnect_budget=0)
        member.serve(on_message=lambda msg: got.append(m.decode(msg.payload)) if msg.kind is Kind.CONTROL else None)
        yield Nodes(started[1], started[0], member, got)
    finally:
        if member is not None:
            member.close()
        for node in reversed(started):
            node.stop()


_nonces = iter(range(1, 2**32))


def nonce() -> str:
    return f"{next(_nonces):016x}"


def generate(n: Nodes, **fields) -> str:
    """A GENERATE of ``fields`` over a valid one, sent to the prefill node; its nonce."""
    doc = {"nonce": nonce(), "prompt": list(PROMPT), "params": dict(PARAMS), "ignore_eos": True, **fields}
    n.member.send(PeerId.parse(n.prefill.bind), Kind.CONTROL, m.encode(MsgType.GENERATE, doc))
    return doc["nonce"]


def hand_off(n: Nodes, prompt=PROMPT, count: int | None = None, **meta) -> str:
    """A KV handoff of ``prompt`` (zero tensors) whose request document is ``meta`` over a valid one; its nonce.
    Two tokens: the first (``first``) goes through the model for the second."""
    doc = {"nonce": nonce(), "router": str(n.member.identity), "params": {**PARAMS, "max_tokens": 2},
           "first": [5, "", None, []], "top_logprobs": 0, "ignore_eos": True, "draws": 0, **meta}
    header = encode_header(doc, prompt, LAYOUT)
    if count is not None:  # a forged prompt length: the ids that follow stay those of ``prompt``
        at = 10 + int.from_bytes(header[6:10], "big")  # after the document of M bytes
        header = header[:at] + count.to_bytes(4, "big") + header[at + 4:]
    with n.member.open_stream(PeerId.parse(n.decode.bind)) as s:
        s.write(header)
        for part in encode_chunks([np.zeros(LAYOUT.nbytes(len(prompt)), np.uint8)]):
            s.write(part)
    return doc["nonce"]


def assert_refused(n: Nodes, rid: str, node: RoleNode, code: ErrorCode, *words: str) -> None:
    kind, doc = n.answer(rid, (MsgType.ERROR, MsgType.HANDED_OFF, MsgType.FINISH, MsgType.TOKENS), node)
    assert kind is MsgType.ERROR, f"{rid} was not refused: {kind.name} {doc}"
    assert doc["code"] == code, doc
    for word in words:
        assert word in doc["message"], doc


def assert_served(n: Nodes) -> None:
    """A valid request still goes through prefill, handoff and decode to its FINISH."""
    rid = generate(n)
    kind, doc = n.answer(rid, (MsgType.FINISH, MsgType.ERROR), n.decode)
    assert kind is MsgType.FINISH and doc["completion_tokens"] == 1, doc


def assert_nothing_held(n: Nodes) -> None:
    for node in (n.prefill, n.decode):
        state = node.state()
        assert state["sequences"] == 0 and state["kv_sequences"] == 0, state


# -- the findings -------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [2**32 - 1, VOCAB, 600])
def test_a_prefill_node_refuses_a_prompt_id_outside_the_vocabulary_and_keeps_serving(nodes, bad):
    before = nodes.prefill.state()
    rid = generate(nodes, prompt=[1, 40, bad, 42])
    assert_refused(nodes, rid, nodes.prefill, ErrorCode.BAD_REQUEST,
                   f"token id {bad} in `prompt` is out of range [0, {VOCAB})")
    after = nodes.prefill.state()
    assert after["handoffs"] == before["handoffs"] and after["refused"] == before["refused"]
    assert_nothing_held(nodes)
    assert_served(nodes)


@pytest.mark.parametrize("bad", [2**32 - 1, VOCAB, 600])
def test_a_decode_node_refuses_a_first_token_outside_the_vocabulary_and_keeps_serving(nodes, bad):
    rid = hand_off(nodes, first=[bad, "", None, []])
    assert_refused(nodes, rid, nodes.decode, ErrorCode.BAD_REQUEST,
                   f"token id {bad} in `first` is out of range [0, {VOCAB})")
    assert_nothing_held(nodes)
    assert_served(nodes)


@pytest.mark.parametrize("bad", [2**32 - 1, VOCAB, 600])
def test_a_decode_node_refuses_a_handoff_prompt_id_outside_the_vocabulary(nodes, bad):
    rid = hand_off(nodes, prompt=(1, 40, bad, 42))
    assert_refused(nodes, rid, nodes.decode, ErrorCode.BAD_TENSOR,
                   f"token id {bad} in `prompt` is out of range [0, {VOCAB})")
    assert_nothing_held(nodes)
    assert_served(nodes)


# -- every id, id length and count field, random values: never a crash, always the documented code -----


def _prefill_case(field: str, value: int) -> tuple[dict, ErrorCode | None]:
    """The GENERATE fields for ``value`` in ``field``, and the code documented for it (None: accepted)."""
    if field == "prompt id":
        return {"prompt": [1, value]}, None if 0 <= value < VOCAB else ErrorCode.BAD_REQUEST
    if field == "prompt length":
        length = value % (CONTEXT + 64)  # a list of 2^32 ids does not fit a control message
        return {"prompt": [1] * length}, None if 1 <= length <= CONTEXT else ErrorCode.BAD_REQUEST
    if field == "max_tokens":
        return {"params": {**PARAMS, "max_tokens": value}}, None if 1 <= value <= 2**31 else ErrorCode.BAD_REQUEST
    assert field == "top_logprobs"
    return {"top_logprobs": value}, None if 0 <= value <= 20 else ErrorCode.BAD_REQUEST


@PROPERTY
@given(field=st.sampled_from(["prompt id", "prompt length", "max_tokens", "top_logprobs"]), value=ANY_INT)
@example(field="prompt id", value=2**32 - 1)
@example(field="prompt id", value=VOCAB - 1)
def test_any_integer_in_a_generate_field_gets_its_documented_code(nodes, field, value):
    fields, code = _prefill_case(field, value)
    if code is None and field != "prompt id":
        fields["params"] = {**fields.get("params", PARAMS), "max_tokens": 1}  # accepted: keep the work small
    rid = generate(nodes, **fields)
    if code is None:
        kind, doc = nodes.answer(rid, (MsgType.FINISH, MsgType.ERROR), nodes.decode)
        assert kind is MsgType.FINISH, doc
    else:
        assert_refused(nodes, rid, nodes.prefill, code, field.split()[0])
    assert nodes.prefill.proc.poll() is None and nodes.decode.proc.poll() is None


def _decode_case(field: str, value: int) -> tuple[dict, ErrorCode | None]:
    """The handoff arguments for ``value`` in ``field``, and the code documented for it (None: accepted)."""
    u32 = value % 2**32  # binary header fields are u32: every value the wire can carry
    if field == "first":
        return {"first": [value, "", None, []]}, None if 0 <= value < VOCAB else ErrorCode.BAD_REQUEST
    if field == "first top_logprobs id":
        return {"first": [5, "", -0.5, [[value, -0.5]]]}, None if 0 <= value < VOCAB else ErrorCode.BAD_REQUEST
    if field == "prompt id":
        return {"prompt": (1, u32)}, None if u32 < VOCAB else ErrorCode.BAD_TENSOR
    if field == "prompt length":
        return {"count": u32}, None if u32 == len(PROMPT) else ErrorCode.BAD_TENSOR
    if field == "draws":
        return {"draws": value}, None if 0 <= value <= MAX_TOKENS_LIMIT + 1 else ErrorCode.BAD_REQUEST
    assert field == "top_logprobs"
    return {"top_logprobs": value}, None if 0 <= value <= 20 else ErrorCode.BAD_REQUEST


@PROPERTY
@given(field=st.sampled_from(["first", "first top_logprobs id", "prompt id", "prompt length", "draws",
                              "top_logprobs"]), value=ANY_INT)
@example(field="first", value=2**32 - 1)
@example(field="prompt id", value=VOCAB)
def test_any_integer_in_a_handoff_field_gets_its_documented_code(nodes, field, value):
    args, code = _decode_case(field, value)
    rid = hand_off(nodes, **args)
    if code is None:
        kind, doc = nodes.answer(rid, (MsgType.FINISH, MsgType.ERROR), nodes.decode)
        assert kind is MsgType.FINISH, doc
    elif field == "prompt length" and 1 <= value % 2**32 <= CONTEXT:
        # in bounds but not the ids that follow: the header misreads as a cut (format) or a wrong layer count
        kind, doc = nodes.answer(rid, (MsgType.ERROR, MsgType.FINISH), nodes.decode)
        assert kind is MsgType.ERROR and doc["code"] in (ErrorCode.BAD_REQUEST, ErrorCode.BAD_TENSOR), doc
    else:
        assert_refused(nodes, rid, nodes.decode, code)
    assert nodes.decode.proc.poll() is None and nodes.prefill.proc.poll() is None


# -- the pure decoders, many more examples -------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(value=ANY_INT, where=st.sampled_from(["prompt", "first", "first top", "header"]))
def test_the_decoders_bound_every_id_by_the_vocabulary(value, where):
    """``Generate.parse``, ``HandoffMeta.parse`` and ``HandoffDecoder``: an id is accepted iff in [0, VOCAB)."""
    from mlxcel.disagg.kv_codec import HandoffDecoder, HandoffError

    ok = 0 <= value < VOCAB
    try:
        if where == "prompt":
            doc = {"nonce": "00000000000000ab", "prompt": [1, value], "params": PARAMS}
            m.Generate.parse(doc, CONTEXT, VOCAB)
        elif where.startswith("first"):
            first = [value, "", None, []] if where == "first" else [5, "", -1.0, [[value, -1.0]]]
            m.HandoffMeta.parse({"nonce": "00000000000000ab", "router": "127.0.0.1:9", "params": PARAMS,
                                 "first": first, "draws": 0}, VOCAB)
        else:
            if not 0 <= value < 2**32:
                return  # the header's ids are u32: nothing else can be sent
            HandoffDecoder(LAYOUT, CONTEXT, VOCAB).feed(encode_header({"nonce": "00000000000000ab"}, (1, value),
                                                                      LAYOUT))
    except m.MessageRefused as exc:
        assert not ok and exc.code is ErrorCode.BAD_REQUEST, exc
        assert str(exc).endswith(f"in `{'first' if where.startswith('first') else 'prompt'}` is out of range "
                                 f"[0, {VOCAB})") or not 0 <= value <= 2**32 - 1, exc
    except HandoffError as exc:
        assert not ok and exc.code is ErrorCode.BAD_TENSOR and f"[0, {VOCAB})" in str(exc), exc
    else:
        assert ok, f"{where}: {value} was accepted"


# -- the logits processors' fields (logit_bias): bounded by the receiver, whoever holds the secret ---------


OVERSIZE_BIAS = {str(i): 1.0 for i in range(301)}  # one past the bound: refused before a single entry is used


@pytest.mark.parametrize("bias,words", [
    (OVERSIZE_BIAS, "logit_bias holds 301 entries; at most 300"),
    ({str(VOCAB): 5.0}, f"logit_bias names token {VOCAB}; the vocabulary has {VOCAB}"),
    ({"7": 101.0}, "logit_bias values must be numbers between -100 and 100"),
    ({"-1": 1.0}, "logit_bias keys must be token ids"),
])
def test_a_prefill_node_refuses_a_bad_logit_bias_and_keeps_serving(nodes, bias, words):
    rid = generate(nodes, params={**PARAMS, "logit_bias": bias})
    assert_refused(nodes, rid, nodes.prefill, ErrorCode.BAD_REQUEST, words)
    assert_nothing_held(nodes)
    assert_served(nodes)


@pytest.mark.parametrize("bias,words", [
    (OVERSIZE_BIAS, "logit_bias holds 301 entries; at most 300"),
    ({str(2**32 - 1): 5.0}, f"logit_bias names token {2**32 - 1}; the vocabulary has {VOCAB}"),
])
def test_a_decode_node_refuses_a_handoff_with_a_bad_logit_bias(nodes, bias, words):
    rid = hand_off(nodes, params={**PARAMS, "max_tokens": 2, "logit_bias": bias})
    assert_refused(nodes, rid, nodes.decode, ErrorCode.BAD_REQUEST, words)
    assert_nothing_held(nodes)
    assert_served(nodes)


def test_a_handoff_s_logit_bias_and_penalties_reach_the_decode_node_s_sampler(nodes):
    """+100 on token 9: the second token (sampled on the decode node) is 9."""
    rid = hand_off(nodes, params={**PARAMS, "max_tokens": 2, "logit_bias": {"9": 100.0}, "presence_penalty": 1.0})
    kind, doc = nodes.answer(rid, (MsgType.FINISH, MsgType.ERROR), nodes.decode)
    assert kind is MsgType.FINISH, doc
    tokens = [e[0] for k, d in list(nodes.got) if k is MsgType.TOKENS and d.get("nonce") == rid for e in d["events"]]
    assert tokens == [5, 9], tokens


# -- a grammar (constrained decoding): bounded, compiled and replayed by each node that samples ------------


HI = 'start: "hi"'  # the tiny tokenizer is byte-level: "h" is token 74, "i" 75; then only EOS
H, I = 74, 75
OVERSIZE_GRAMMAR = "a" * (64 * 1024 + 1)


def constrained_tokens(n: Nodes, rid: str) -> tuple[list[int], dict]:
    """The token ids of a request's completion (the decode node's TOKENS: a prefill node's early first token,
    docs/disagg.md §3.1, comes again from the decode node), and its FINISH document."""
    kind, doc = n.answer(rid, (MsgType.FINISH, MsgType.ERROR), n.decode)
    assert kind is MsgType.FINISH, doc
    got = [e[0] for k, d in list(n.got) if k is MsgType.TOKENS and d.get("nonce") == rid for e in d["events"]]
    return got[len(got) - doc["completion_tokens"]:], doc


def assert_constrained_served(n: Nodes) -> None:
    """A constrained request still goes through both nodes: the grammar's text, then stop."""
    rid = generate(n, params={**PARAMS, "max_tokens": 4, "grammar": HI}, ignore_eos=False)
    tokens, finish = constrained_tokens(n, rid)
    assert tokens == [H, I] and finish["reason"] == "stop", (tokens, finish)


@pytest.mark.parametrize("fields,words", [
    ({"params": {**PARAMS, "grammar": OVERSIZE_GRAMMAR}}, "grammar is 65537 bytes; at most 65536 are accepted"),
    ({"params": {**PARAMS, "grammar": "start: foo("}}, "grammar does not compile"),
    ({"params": {**PARAMS, "grammar": HI}, "prompt": [1, 40, H, H], "draws": 2},
     "the 2 replayed token(s) do not match the grammar"),
    ({"params": {**PARAMS, "grammar": HI}, "prompt": [1, 40, H, VOCAB], "draws": 2}, "out of range"),
    ({"params": {**PARAMS, "grammar": HI}, "prompt": [H], "draws": 1},
     "draws (1) must be fewer than the prompt's 1 token(s)"),
], ids=["oversize", "uncompilable", "replay-refused", "replay-out-of-vocabulary", "replay-longer-than-prompt"])
def test_a_prefill_node_refuses_a_bad_grammar_and_keeps_serving(nodes, fields, words):
    """The prefill node samples the first token: it bounds the grammar, compiles it and replays a resumed
    request's earlier tokens (the prompt's last ``draws``); each refusal is BAD_REQUEST, nothing is held."""
    rid = generate(nodes, ignore_eos=False, **fields)
    assert_refused(nodes, rid, nodes.prefill, ErrorCode.BAD_REQUEST, words)
    assert_nothing_held(nodes)
    assert_constrained_served(nodes)


@pytest.mark.parametrize("meta,words", [
    ({"params": {**PARAMS, "max_tokens": 2, "grammar": OVERSIZE_GRAMMAR}, "generated": 1},
     "grammar is 65537 bytes; at most 65536 are accepted"),
    ({"params": {**PARAMS, "max_tokens": 2, "grammar": "start: foo("}, "generated": 1}, "grammar does not compile"),
    ({"params": {**PARAMS, "max_tokens": 2, "grammar": HI}, "generated": 1, "first": [I, "", None, []]},
     "the 1 replayed token(s) do not match the grammar"),
    ({"params": {**PARAMS, "max_tokens": 2}, "generated": 1}, "generated is sent only with a grammar"),
    ({"params": {**PARAMS, "max_tokens": 2, "grammar": HI}}, "generated"),
    ({"params": {**PARAMS, "max_tokens": 2, "grammar": HI}, "generated": 5, "first": [H, "", None, []]},
     "generated (5) must be at most the handoff's 4 prompt ids"),
], ids=["oversize", "uncompilable", "replay-refused", "replay-without-grammar", "grammar-without-replay",
        "replay-longer-than-prompt"])
def test_a_decode_node_refuses_a_handoff_with_a_bad_grammar_and_keeps_serving(nodes, meta, words):
    """The decode node samples the rest: it compiles the grammar again and replays the tokens generated
    so far (``generated``: the first token here); each refusal is BAD_REQUEST, nothing is held."""
    rid = hand_off(nodes, ignore_eos=False, **meta)
    assert_refused(nodes, rid, nodes.decode, ErrorCode.BAD_REQUEST, words)
    assert_nothing_held(nodes)
    assert_constrained_served(nodes)


def test_a_handoff_s_grammar_goes_on_from_its_replay(nodes):
    """A handoff whose first token is the grammar's first: the decode node allows only "i", then stop."""
    rid = hand_off(nodes, params={**PARAMS, "max_tokens": 4, "grammar": HI}, generated=1,
                   first=[H, "h", None, []], ignore_eos=False)
    tokens, finish = constrained_tokens(nodes, rid)
    assert tokens == [H, I] and finish["reason"] == "stop", (tokens, finish)
