"""The tensor-parallel control channel bounds every token id by the follower's vocabulary (issue 21).

``decode`` is pure: random integers across the whole range in every field that carries a token id,
an id list's length or a count either decode (in bounds) or raise ``ControlError`` naming the
field, never anything else. A follower answers a bad ``prepare`` with BAD_REQUEST and prepares nothing.
"""

from __future__ import annotations

import json
import queue

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlxcel.cluster.errors import RequestError
from mlxcel.cluster.identity import PeerId
from mlxcel.cluster.messages import Message
from mlxcel.cluster.wire import Kind
from mlxcel.config import MAX_PREFIX_TOKENS, TP_MAX_ROWS, TP_MAX_STEP_TOKENS
from mlxcel.error_codes import ErrorCode
from mlxcel.parallel.control import ControlError, decode
from mlxcel.parallel.follower import FollowerControl

VOCAB = 512
EDGES = (2**32 - 1, 2**32, 2**31, 2**31 - 1, VOCAB, VOCAB - 1, 600, 0, -1, -(2**31), 2**63)
ANY_INT = st.one_of(st.sampled_from(EDGES), st.integers(-(2**64), 2**64))


def message(op: str, **fields) -> bytes:
    return json.dumps({"op": op, **fields}).encode()


def step(tokens) -> bytes:
    return message("step", kind="decode", rids=[f"r{i}" for i in range(len(tokens))], tokens=tokens, slot=0,
                   sample=True)


@pytest.mark.parametrize("payload,field", [
    (step([[2**32 - 1]]), "tokens"),
    (step([[1], [VOCAB]]), "tokens"),
    (message("release", rid="r", tokens=[1, 2, 600]), "tokens"),
    (message("prepare", rid="r", prompt=[1, -1], limit=0), "prompt"),
])
def test_an_id_outside_the_vocabulary_is_refused_naming_the_field_and_the_bound(payload, field):
    with pytest.raises(ControlError, match=rf"^token id -?\d+ in `{field}` is out of range \[0, {VOCAB}\)$"):
        decode(payload, VOCAB)


@settings(max_examples=150, deadline=None)
@given(field=st.sampled_from(["step token", "step rows", "step width", "slot", "release token", "release length",
                              "prepare token", "prepare length", "limit"]), value=ANY_INT)
def test_any_integer_in_an_id_or_count_field_decodes_or_is_a_control_error(field, value):
    payload, ok = _case(field, value)
    try:
        out = decode(payload, VOCAB)
    except ControlError:
        assert not ok, f"{field}={value} was refused"
        return
    assert ok, f"{field}={value} was accepted: {out}"


def _case(field: str, value: int) -> tuple[bytes, bool]:
    """A control message with ``value`` in ``field`` (a length: ``value`` picks 0, 1, the bound or one over)."""
    in_vocab = 0 <= value < VOCAB
    if field == "step token":
        return step([[1, value]]), in_vocab
    if field == "step rows":
        rows = _length(value, TP_MAX_ROWS)
        return step([[1]] * rows), 1 <= rows <= TP_MAX_ROWS
    if field == "step width":
        width = _length(value, TP_MAX_STEP_TOKENS)
        return step([[1] * width]), 1 <= width <= TP_MAX_STEP_TOKENS
    if field == "slot":
        return message("step", kind="decode", rids=["r"], tokens=[[1]], slot=value, sample=True), \
            -1 <= value <= TP_MAX_ROWS
    if field == "release token":
        return message("release", rid="r", tokens=[value]), in_vocab
    if field == "release length":
        n = _length(value, MAX_PREFIX_TOKENS * 2)
        return message("release", rid="r", tokens=[1] * n), n <= MAX_PREFIX_TOKENS * 2
    if field == "prepare token":
        return message("prepare", rid="r", prompt=[value], limit=0), in_vocab
    if field == "prepare length":
        n = _length(value, 300)
        return message("prepare", rid="r", prompt=[1] * n, limit=0), True
    assert field == "limit"
    return message("prepare", rid="r", prompt=[1], limit=value), 0 <= value <= 2**31


def _length(value: int, bound: int) -> int:
    return (0, 1, bound, bound + 1)[value % 4]


def test_a_follower_answers_a_bad_prepare_with_bad_request_and_queues_nothing():
    control = FollowerControl.__new__(FollowerControl)  # its checks only: no transport, no model
    control.rank0, control.rank, control.timeout, control.vocab_size = PeerId.parse("127.0.0.1:9"), 1, 1.0, VOCAB
    control.inbox = queue.SimpleQueue()
    msg = Message(PeerId.parse("127.0.0.1:9"), Kind.RPC_REQUEST,
                  memoryview(message("prepare", rid="r", prompt=[1, 2**32 - 1], limit=4)), 1)
    with pytest.raises(RequestError) as err:
        control._on_request(msg)
    assert err.value.code is ErrorCode.BAD_REQUEST and f"[0, {VOCAB})" in str(err.value)
    assert control.inbox.empty()
