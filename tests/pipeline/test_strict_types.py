"""Booleans are not integers or numbers: every numeric field of every stage message refuses them.

JSON messages (PREPARE, ACK, RELEASE, STATE, ERROR): each row names a message, a numeric field, a
valid message, and the receiver's check; the test puts ``true`` (and ``false``) where the number
goes and expects the check to refuse it, while the valid message passes. A second test keeps the table complete
against the JSON field tables of docs/pipeline.md. The step messages (RUN_ENTRY, ACTIVATION,
RUN_RESULT) have a binary header where a boolean cannot stand for a number on the wire; their
encoder refuses one, and the coordinator's checks of a RUN_RESULT's fields refuse one too.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

from mlxcel.error_codes import ErrorCode
from mlxcel.pipeline.coordinator import result_is_for, result_tokens
from mlxcel.pipeline.params import count_from_wire, params_from_wire, tokens_from_wire
from mlxcel.pipeline.protocol import MsgType, ProtocolError, check_state, decode, encode

DOCS = Path(__file__).resolve().parents[2] / "docs" / "pipeline.md"
VOCAB, WIDTH = 100, 8


def _params(h: dict) -> None:
    params_from_wire(h)


def _descriptor(h: dict) -> None:
    import json
    body = json.dumps({"tensors": [{"name": "input_ids", "dtype": "int32", "shape": h["shape"]}]}).encode()
    decode(bytes([MsgType.PREPARE]) + len(body).to_bytes(4, "big") + body + bytes(4))


def _result(h: dict) -> None:
    if not result_is_for(h, ["r"], 0):
        raise ValueError("not this step's result")
    result_tokens(h, 1, VOCAB)


def _tokens(name: str) -> Callable[[dict], None]:
    return lambda h: tokens_from_wire(h[name], name, VOCAB)


def _count(name: str, most: int) -> Callable[[dict], None]:
    return lambda h: count_from_wire(h[name], name, most)


def _error(h: dict) -> None:
    if ErrorCode.from_wire(h["code"]) is ErrorCode.UNKNOWN:
        raise ValueError("unknown code")


STEP = {"nonce": "0123456789abcdef", "phase": "decode", "micro_batch": 0, "request_ids": ["r"], "sample": True}
STATE = {"node_id": "stage-0", "cluster": "c", "stage": 0, "layers": [0, 2], "num_layers": 2, "hidden_size": 8,
         "vocab_size": VOCAB, "sequences": 0, "draining": False, "steps": 0, "sent_frames": 0, "sent_bytes": 0}
RESULT = {**STEP, "tokens": [5], "logprobs": [-0.5], "top_logprobs": [[[5, -0.5]]]}

# (message, field path, valid header, check)
FIELDS: list[tuple[str, tuple, dict, Callable[[dict], None]]] = [
    ("PREPARE", ("temperature",), {"temperature": 0.5}, _params),
    ("PREPARE", ("top_p",), {"top_p": 0.5}, _params),
    ("PREPARE", ("top_k",), {"top_k": 3}, _params),
    ("PREPARE", ("seed",), {"seed": 1}, _params),
    ("PREPARE", ("top_logprobs",), {"top_logprobs": 1, "logprobs": True}, _params),
    ("PREPARE", ("min_p",), {"min_p": 0.5}, _params),
    ("PREPARE", ("repetition_penalty",), {"repetition_penalty": 1.2}, _params),
    ("PREPARE", ("presence_penalty",), {"presence_penalty": 0.5}, _params),
    ("PREPARE", ("frequency_penalty",), {"frequency_penalty": 0.5}, _params),
    ("PREPARE", ("logit_bias", "7"), {"logit_bias": {"7": 1.0}}, _params),  # true is not a bias of 1
    ("PREPARE", ("context", 1), {"context": [7, 1, 2]}, _params),  # true is not token 1
    ("PREPARE", ("replay", 1), {"replay": [7, 1, 2], "grammar": "start: /[0-9]+/"}, _params),  # true is not token 1
    ("PREPARE", ("grammar",), {"grammar": "start: /[0-9]+/"}, _params),  # a grammar is text, not a number
    ("PREPARE", ("prompt", 1), {"prompt": [7, 1, 2]}, _tokens("prompt")),  # true is not token 1
    ("PREPARE", ("max_cached",), {"max_cached": 1}, _count("max_cached", 1 << 16)),
    ("PREPARE", ("draws",), {"draws": 1}, _count("draws", 1 << 20)),  # a resumed sequence's sampler offset
    ("ACK", ("cached",), {"cached": 1}, _count("cached", 5)),
    ("RELEASE", ("tokens", 1), {"tokens": [7, 1, 2]}, _tokens("tokens")),
    ("tensor descriptor", ("shape", 0), {"shape": [1, 1]}, _descriptor),
    ("RUN_RESULT", ("micro_batch",), dict(RESULT), _result),
    ("RUN_RESULT", ("tokens", 0), dict(RESULT), _result),
    ("RUN_RESULT", ("logprobs", 0), dict(RESULT), _result),
    ("RUN_RESULT", ("top_logprobs", 0, 0, 0), dict(RESULT), _result),
    ("RUN_RESULT", ("top_logprobs", 0, 0, 1), dict(RESULT), _result),
    *[("STATE", (name,), dict(STATE), check_state) for name in
      ("stage", "num_layers", "hidden_size", "vocab_size", "sequences", "steps", "overlapped", "sent_frames", "sent_bytes",
       "prefix_bytes")],
    *[("STATE", (name,), {**STATE, name: 0.5}, check_state) for name in ("read_s", "queue_s", "compute_s", "send_s")],
    ("STATE", ("layers", 0), dict(STATE), check_state),
    ("STATE", ("layers", 1), dict(STATE), check_state),
    ("ERROR", ("code",), {"code": 4}, _error),
]


def _replace(header: dict, path: tuple, value: Any) -> dict:
    import copy
    out = copy.deepcopy(header)
    node = out
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return out


@pytest.mark.parametrize("message,path,valid,check", FIELDS, ids=[f"{m}.{'.'.join(map(str, p))}" for m, p, *_ in FIELDS])
@pytest.mark.parametrize("boolean", [True, False])
def test_a_boolean_is_refused_where_a_number_goes(message, path, valid, check, boolean):
    check(valid)  # the valid message passes
    with pytest.raises((ProtocolError, ValueError, TypeError)) as refused:
        check(_replace(valid, path, boolean))
    if isinstance(refused.value, ProtocolError):
        assert refused.value.code in (ErrorCode.BAD_REQUEST, ErrorCode.BAD_TENSOR)


@pytest.mark.parametrize("mtype,field,tensor", [
    ("RUN_ENTRY", "micro_batch", {"input_ids": ("int32", np.array([[7]], np.int32))}),
    ("ACTIVATION", "micro_batch", {"hidden": ("float32", np.zeros((1, 1, WIDTH), np.float32))}),
    ("RUN_RESULT", "micro_batch", None),
])
def test_the_step_encoder_refuses_a_boolean(mtype, field, tensor):
    header = {**STEP, "tokens": [5]} if mtype == "RUN_RESULT" else dict(STEP)
    encode(MsgType[mtype], header, tensor)
    with pytest.raises(TypeError):
        encode(MsgType[mtype], {**header, field: True}, tensor)
    with pytest.raises(TypeError):
        encode(MsgType.RUN_RESULT, {**STEP, "tokens": [True]})


JSON_MESSAGES = {"PREPARE", "STATE", "ERROR", "ACK", "GET_STATE", "CANCEL", "RELEASE", "BEGIN_DRAIN", "SHUTDOWN"}


def _documented_numeric_fields() -> set[tuple[str, str]]:
    """(message, field) for every header field docs/pipeline.md §3.5 types as integer or number."""
    text = DOCS.read_text()
    section = text[text.index("### 3.5 Header fields"):text.index("### 3.6")]
    found, message = set(), ""
    for line in section.splitlines():
        head = re.match(r"^\*\*([A-Z_]+)\*\*", line)
        if head:
            message = head.group(1)
        if line.startswith("**STATE**") or "**STATE**:" in line:
            message = "STATE"
        row = re.match(r"^\| (`[^|]+`) \| ([^|]+) \|", line)
        if row and re.search(r"\b(integer|number)", row.group(2)) and message in JSON_MESSAGES:
            for field in re.findall(r"`(\w+)`", row.group(1)):
                found.add(("PREPARE" if message == "PREPARE" else message, field))
    return found


def test_the_table_covers_every_numeric_field_the_docs_define():
    covered = {(m, p[0]) for m, p, *_ in FIELDS}
    missing = _documented_numeric_fields() - covered
    assert not missing, f"numeric fields without a boolean check: {sorted(missing)}"
    assert ("STATE", "stage") in _documented_numeric_fields() and ("PREPARE", "temperature") in _documented_numeric_fields()
