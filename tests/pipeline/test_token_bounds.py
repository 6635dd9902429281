"""Random integers in every stage field that carries a token id or a count (issue 21).

Real stages on real transports (``test_authorization``'s ``strict`` pipeline); the coordinator's own
transport sends RUN_ENTRY ``input_ids`` (int32 and uint32), PREPARE ``prompt`` and ``max_cached``, and
RELEASE ``tokens`` with values across the whole integer range. Each out-of-bounds value gets its
documented ERROR code (docs/pipeline.md §4.3) and changes nothing; afterwards the stage still gives
the whole model's tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from mlxcel.cluster.wire import Kind
from mlxcel.config import MAX_PREFIX_TOKENS
from mlxcel.engine.sampling import SamplingParams
from mlxcel.pipeline.protocol import MsgType, encode, new_nonce
from tests.pipeline.test_authorization import (  # noqa: F401 - fixtures
    GREEDY,
    PROMPT,
    VOCAB,
    code_name,
    expected,
    facts,
    finish_victim,
    model,
    rid,
    start_victim,
    strict,
)
from tests.pipeline.members import GreedyRun, wait_until

EDGES = (2**32 - 1, 2**31, 2**31 - 1, VOCAB, VOCAB - 1, 600, 0, -1, -(2**31), 2**32, 2**63)
FIELDS = ["input_ids int32", "input_ids uint32", "prompt", "max_cached", "tokens"]


def _wrap(value: int, dtype: str) -> int:
    """``value`` as the wire's ``dtype`` can carry it (int32 or uint32 bits)."""
    return value % 2**32 if dtype == "uint32" else (value + 2**31) % 2**32 - 2**31


def _message(field: str, value: int, victim: str) -> tuple[bytes, str | None, str]:
    """(payload, documented code or None for accepted, nonce) of a command with ``value`` in ``field``."""
    nonce = new_nonce()
    if field.startswith("input_ids"):
        dtype = field.split()[1]
        v = _wrap(value, dtype)
        header = {"nonce": nonce, "phase": "decode", "micro_batch": 0, "request_ids": [victim], "sample": True}
        payload = encode(MsgType.RUN_ENTRY, header, {"input_ids": (dtype, np.array([[v]], dtype=dtype))})
        return payload, None if 0 <= v < VOCAB else "bad_tensor", nonce
    if field == "tokens":
        header = {"nonce": nonce, "request_id": rid("released"), "tokens": [1, 40, 41, value]}
        return encode(MsgType.RELEASE, header), None if 0 <= value < VOCAB else "bad_request", nonce
    header = {"nonce": nonce, "request_id": rid("prepared"), "params": GREEDY, "prompt": [1, 40, 41, 42]}
    if field == "prompt":
        header["prompt"] = [1, value]
        code = None if 0 <= value < VOCAB else "bad_request"
    else:
        header["max_cached"] = value
        code = None if 0 <= value <= MAX_PREFIX_TOKENS else "bad_request"
    return encode(MsgType.PREPARE, header), code, nonce


_runs: list = []


def _target(strict) -> str:
    """The one prepared sequence the RUN_ENTRY cases aim at (only refused ids are sent to it)."""
    if not _runs:
        _runs.append(start_victim(strict, [], tokens=0))
    return _runs[0].rid


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(field=st.sampled_from(FIELDS),
       value=st.one_of(st.sampled_from(EDGES), st.integers(-(2**40), 2**40), st.integers(0, 2**32 - 1)))
@example(field="input_ids uint32", value=2**32 - 1)
@example(field="input_ids int32", value=-1)
@example(field="prompt", value=2**32 - 1)
@example(field="tokens", value=VOCAB)
def test_any_integer_in_a_stage_field_gets_its_documented_code(strict, field, value):
    payload, code, nonce = _message(field, value, _target(strict))
    if code is None and field.startswith("input_ids"):
        return  # an accepted id is a real decode step: the normal path, run by the test below
    strict.coordinator.transport.send(strict.addr(0), Kind.TENSOR_DATA, payload)
    if code is None and field == "tokens":
        return  # RELEASE is one-way: nothing to answer
    assert wait_until(lambda: strict.tap.about(nonce)), f"no answer to {field}={value}"
    (_, m), = strict.tap.about(nonce)
    if code is None:
        assert m.type is MsgType.ACK, m.header
        strict.coordinator.transport.send(strict.addr(0), Kind.TENSOR_DATA, encode(
            MsgType.RELEASE, {"nonce": new_nonce(), "request_id": decode_rid(payload)}))
        return
    assert m.type is MsgType.ERROR and code_name(m.header["code"]) == code, m.header
    if field != "max_cached":
        assert f"is out of range [0, {VOCAB})" in m.header["message"] or "token id" in m.header["message"], m.header


def decode_rid(payload: bytes) -> str:
    from mlxcel.pipeline.protocol import decode

    return decode(payload).header["request_id"]


def test_the_stages_still_serve_the_whole_models_tokens(strict, expected):
    """After every refusal: nothing held but what the tests prepared, and the whole model's tokens."""
    for run in _runs:
        run.release()
    victim = start_victim(strict, expected)
    finish_victim(strict, victim, expected)
    assert wait_until(lambda: all(len(s.runner) == 0 for s in strict.real()))


def _prepare_with(strict, params: dict, request_id: str = "biased") -> tuple[str, str, str]:
    """(answer type, code) of a PREPARE whose ``params`` are GREEDY's with ``params`` over them, sent by the
    coordinator's own identity (trusted for protocol, not for sizes) to the last stage."""
    nonce = new_nonce()
    header = {"nonce": nonce, "request_id": rid(request_id), "params": {**GREEDY, **params}}
    strict.coordinator.transport.send(strict.addr(1), Kind.TENSOR_DATA, encode(MsgType.PREPARE, header))
    assert wait_until(lambda: strict.tap.about(nonce)), f"no answer to {list(params)}"
    (_, m), = strict.tap.about(nonce)
    return m.type.name, code_name(m.header.get("code")) if m.type is MsgType.ERROR else "", m.header.get("message", "")


def test_a_stage_refuses_an_oversize_or_out_of_vocabulary_logit_bias_or_context(strict):
    many = {str(i): 1.0 for i in range(3000)}  # as many as a PREPARE header carries (a million does not fit)
    cases = [({"logit_bias": many}, "logit_bias holds 3000 entries; at most 300"),
             ({"logit_bias": {str(VOCAB): 1.0}}, f"logit_bias names token {VOCAB}"),
             ({"logit_bias": {"3": -100.5}}, "between -100 and 100"),
             ({"presence_penalty": 2.5}, "presence_penalty must be between -2 and 2"),
             ({"context": list(range(21))}, "context must be a list of at most 20 token ids"),
             ({"context": [1, VOCAB]}, f"token id {VOCAB} in `context` is out of range")]
    for params, words in cases:
        kind, code, message = _prepare_with(strict, params)
        assert (kind, code) == ("ERROR", "bad_request") and words in message, (list(params), message[:200])
        assert rid("biased") not in strict.real()[1].runner  # refused: nothing prepared
    kind, _, _ = _prepare_with(strict, {"logit_bias": {"3": 100.0}, "context": [1, 2], "frequency_penalty": 0.5},
                               "accepted")
    assert kind == "ACK"
    strict.coordinator.transport.send(strict.addr(1), Kind.TENSOR_DATA, encode(
        MsgType.RELEASE, {"nonce": new_nonce(), "request_id": rid("accepted")}))
    assert wait_until(lambda: rid("accepted") not in strict.real()[1].runner)


# -- a grammar (constrained decoding): bounded, compiled and replayed by the stage that samples ------------


HI = 'start: "hi"'  # the tiny tokenizer is byte-level: "h" is token 74, "i" 75; then only EOS (2)
H, I, EOS = 74, 75, 2


@pytest.mark.parametrize("params,words", [
    ({"grammar": "a" * (64 * 1024 + 1)}, "grammar is 65537 bytes; at most 65536 are accepted"),
    ({"grammar": "start: foo("}, "grammar does not compile"),
    ({"grammar": HI, "replay": [H, H]}, "the 2 replayed token(s) do not match the grammar"),
    ({"grammar": None, "replay": [H]}, "replay needs a grammar"),
    ({"grammar": HI, "replay": [H, VOCAB]}, f"token id {VOCAB} in `replay` is out of range"),
], ids=["oversize", "uncompilable", "replay-refused", "replay-without-grammar", "replay-out-of-vocabulary"])
def test_a_stage_refuses_a_bad_grammar_or_replay_and_keeps_serving(strict, params, words):
    """The last stage samples: it bounds the grammar's text, compiles it and replays what came before;
    each refusal is bad_request, nothing is prepared, and a constrained request afterwards is served."""
    held = [len(s.runner) for s in strict.real()]
    kind, code, message = _prepare_with(strict, params, "constrained")
    assert (kind, code) == ("ERROR", "bad_request") and words in message, message[:300]
    assert len(message) < 1000  # the oversize text is not echoed back
    assert [len(s.runner) for s in strict.real()] == held  # refused: nothing prepared
    run = GreedyRun(strict.coordinator, rid("hi"), PROMPT, params=SamplingParams(grammar=HI))
    assert run.run(3) == [H, I, EOS]  # the grammar, then only EOS: whatever the random weights prefer
    run.release()
    assert wait_until(lambda: all(run.rid not in s.runner for s in strict.real()))


def test_a_stage_resumes_a_grammar_from_its_replay(strict):
    """A PREPARE whose replay is the grammar's first token: the stage's matcher goes on after it (only "i")."""
    run = GreedyRun(strict.coordinator, rid("resumed"), [*PROMPT, H],
                    params=SamplingParams(grammar=HI), draws=1)
    assert run.run(2) == [I, EOS]
    run.release()
    assert wait_until(lambda: all(run.rid not in s.runner for s in strict.real()))
