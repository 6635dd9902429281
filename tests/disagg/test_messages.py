"""Control messages: round trips and strict field checks (a boolean is never a number)."""

from __future__ import annotations

import json
import re

import pytest

from mlxcel.cluster.identity import PeerId
from mlxcel.disagg import messages as m
from mlxcel.disagg.wire import MAX_CONTROL_LEN, MsgType
from mlxcel.engine.interface import FinishEvent, TokenEvent
from mlxcel.engine.sampling import SamplingParams
from mlxcel.error_codes import ErrorCode

NONCE = "0123456789abcdef"
PARAMS = SamplingParams(max_tokens=9, temperature=0.7, top_p=0.9, top_k=5, seed=3, stop=("x",), logprobs=True)


def round_trip(payload: bytes) -> tuple[MsgType, dict]:
    return m.decode(memoryview(payload))


def test_every_message_round_trips():
    gen = m.Generate(NONCE, (1, 2, 3), PARAMS, 2, True, PeerId.parse("127.0.0.3:9000"))
    kind, doc = round_trip(gen.encode())
    assert kind is MsgType.GENERATE and m.Generate.parse(doc, 8) == gen
    assert gen.request().request_id == NONCE and gen.request().prompt == (1, 2, 3)
    ev = TokenEvent(7, "hé", -0.5, ((7, -0.5), (8, -1.25)))
    assert m.Tokens.parse(round_trip(m.Tokens(NONCE, (ev,)).encode())[1]).events == (ev,)
    fin = FinishEvent("error", "", 3, 4, "boom", ErrorCode.UNREACHABLE)
    assert m.Finish.parse(round_trip(m.Finish(NONCE, fin).encode())[1]).event == fin
    err = m.Error(NONCE, ErrorCode.OVERLOADED, "busy", "127.0.0.9:1")
    assert m.Error.parse(round_trip(err.encode())[1]) == err
    done = m.HandedOff(NONCE, 123, 0.5, "127.0.0.9:1", 0.25)
    assert m.HandedOff.parse(round_trip(done.encode())[1]) == done
    meta = m.HandoffMeta(NONCE, PeerId.parse("127.0.0.2:1"), PARAMS, ev, 2, False, 1)
    assert m.HandoffMeta.parse(json.loads(json.dumps(meta.doc()))).doc() == meta.doc()
    assert round_trip(m.cancel(NONCE)) == (MsgType.CANCEL, {"nonce": NONCE})


def doc_with(**changes) -> dict:
    doc = m.decode(m.Generate(NONCE, (1, 2, 3), PARAMS).encode())[1]
    doc.update(changes)
    return doc


@pytest.mark.parametrize("changes, words", [
    ({"nonce": "XYZ"}, "nonce must be"),
    ({"nonce": 5}, "nonce must be"),
    ({"prompt": []}, "list of 1..8 token ids"),
    ({"prompt": list(range(9))}, "list of 1..8 token ids"),
    ({"prompt": [1, True]}, "not a token id"),
    ({"prompt": [1, -1]}, "not a token id"),
    ({"prompt": [1, 2**32]}, "not a token id"),
    ({"top_logprobs": 21}, "top_logprobs must be an integer in 0..20"),
    ({"top_logprobs": True}, "top_logprobs must be an integer"),
    ({"ignore_eos": 1}, "ignore_eos must be true or false"),
    ({"decode_target": "decode.lan:9000"}, "numeric ip:port"),
    ({"params": {"max_tokens": 0}}, "max_tokens"),
    ({"params": {"max_tokens": True}}, "max_tokens"),
    ({"params": {"max_tokens": 3, "temperature": "hot"}}, "temperature must be a finite number"),
    ({"params": {"max_tokens": 3, "temperature": 5}}, "params.temperature"),
    ({"params": {"max_tokens": 3, "stop": "x"}}, "params.stop must be a list"),
    ({"params": {"max_tokens": 3, "seed": 1.5}}, "seed must be an integer"),
    ({"params": {"max_tokens": 3, "mirostat": 1}}, "unknown field(s) mirostat"),
    ({"params": [1]}, "params must be an object"),
])
def test_generate_fields_are_checked(changes, words):
    with pytest.raises(m.MessageRefused) as info:
        m.Generate.parse(doc_with(**changes), 8)
    assert words in str(info.value) and info.value.code is ErrorCode.BAD_REQUEST


@pytest.mark.parametrize("payload, words", [
    (b"", "empty"),
    (b"\x7f{}", "unknown message type 0x7f"),
    (b"\x01not json", "not JSON"),
    (b"\x01[1,2]", "not a JSON object"),
    (b"\x01\xff\xfe", "not JSON"),
    (b"\x01" + b" " * MAX_CONTROL_LEN, "at most"),
])
def test_malformed_messages_are_refused(payload, words):
    with pytest.raises(m.MessageRefused, match=words):
        m.decode(payload)


@pytest.mark.parametrize("events, words", [
    ([], "1..256 events"),
    ([[1, "a", None, []]] * 257, "1..256 events"),
    ([[1, "a", None]], "must be [token, text, logprob, top_logprobs]"),
    ([[True, "a", None, []]], "not a token id"),
    ([[1, 5, None, []]], "text must be a string"),
    ([[1, "a", "x", []]], "logprob must be a finite number"),
    ([[1, "a", None, [[1]]]], "must be [token, logprob]"),
    ([[1, "a", None, [[1, 0.0]] * 21]], "at most 20 pairs"),
])
def test_token_events_are_checked(events, words):
    with pytest.raises(m.MessageRefused) as info:
        m.Tokens.parse({"nonce": NONCE, "events": events})
    assert words in str(info.value)


def test_finish_and_handoff_meta_are_checked():
    with pytest.raises(m.MessageRefused, match="reason must be one of"):
        m.Finish.parse({"nonce": NONCE, "reason": "done", "text": "", "prompt_tokens": 1, "completion_tokens": 1})
    meta = m.HandoffMeta(NONCE, PeerId.parse("127.0.0.2:1"), PARAMS, TokenEvent(1, ""), draws=1).doc()
    for key, value, words in (("router", "router.lan:1", "router must be"), ("draws", -1, "draws must be"),
                              ("first", [1, "", None], "must be [token")):
        with pytest.raises(m.MessageRefused, match=re.escape(words)):
            m.HandoffMeta.parse({**meta, key: value})


@pytest.mark.parametrize("code", [..., None, 1.0, True, "6", -1, 2**16, [6]])
def test_an_error_code_is_a_json_integer(code):
    doc = {"nonce": NONCE, "message": "x"} if code is ... else {"nonce": NONCE, "message": "x", "code": code}
    with pytest.raises(m.MessageRefused, match="code must be an integer in 0..65535"):
        m.Error.parse(doc)
    if code is not ... and code is not None:  # a FINISH's code is an integer or null
        finish = {"nonce": NONCE, "reason": "error", "text": "", "prompt_tokens": 1, "completion_tokens": 0,
                  "error": "x", "code": code}
        with pytest.raises(m.MessageRefused, match="code must be an integer in 0..65535"):
            m.Finish.parse(finish)


def test_an_unknown_integer_code_reads_as_unknown():
    assert m.Error.parse({"nonce": NONCE, "code": 999, "message": "x"}).code is ErrorCode.UNKNOWN
    finish = {"nonce": NONCE, "reason": "stop", "text": "", "prompt_tokens": 1, "completion_tokens": 1, "code": None}
    assert m.Finish.parse(finish).event.code is None
