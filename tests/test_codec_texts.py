"""The refusal texts of the strict JSON codecs, pinned: control, assignment, disagg and stage messages.

Each line of ``fixtures/codec_texts.txt`` is (codec, input, exception type, message) for one bad (or good)
input; the codecs share their field checks (``mlxcel.cluster.strict_json``) and must keep every text.
Regenerate after a deliberate change with ``MLXCEL_REGEN_CODEC_TEXTS=1``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from mlxcel.bringup import messages as bm
from mlxcel.disagg import messages as dm
from mlxcel.parallel import control
from mlxcel.pipeline import params as pp
from mlxcel.pipeline import protocol as pr
import pytest

pytestmark = pytest.mark.proc  # starts processes (tests/proc_marker.py)

GOLDEN = Path(__file__).resolve().parent / "fixtures" / "codec_texts.txt"


def _run(fn, arg) -> tuple[str, str]:
    """(exception type, text) of one call, or ("ok", "")."""
    try:
        fn(arg)
        return ("ok", "")
    except Exception as e:  # noqa: BLE001 - every refusal is what is pinned
        return (type(e).__name__, str(e))


def observed() -> list[str]:
    seen: list[str] = []
    C = [
     b"[1]", b"{", b'{"op":"nope"}',
     b'{"op":"step","kind":"x"}', b'{"op":"step","kind":"decode","rids":[]}',
     b'{"op":"step","kind":"decode","rids":["a"],"tokens":[[1],[2]]}',
     b'{"op":"step","kind":"decode","rids":["a"],"tokens":[[true]]}',
     b'{"op":"step","kind":"decode","rids":["a"],"tokens":[[]]}',
     b'{"op":"step","kind":"decode","rids":["a"],"tokens":[[1]],"sample":1}',
     b'{"op":"step","kind":"decode","rids":[""],"tokens":[[1]],"sample":true,"slot":0}',
     b'{"op":"step","kind":"decode","rids":["a"],"tokens":[[1]],"sample":true,"slot":true}',
     b'{"op":"step","kind":"decode","rids":["a"],"tokens":[[1]],"sample":true,"slot":-2}',
     b'{"op":"step","kind":"decode","rids":["a"],"tokens":[[1]],"sample":true,"slot":-1}',
     b'{"op":"release","rid":5}', b'{"op":"release","rid":"a","tokens":[1.0]}', b'{"op":"release","rid":"a","tokens":null}',
     b'{"op":"prepare","rid":"a","prompt":"x"}', b'{"op":"prepare","rid":"a","prompt":[1],"limit":false}',
     b'{"op":"hello","rank":0}', b'{"op":"hello","rank":1,"pid":1.5}', b'{"op":"hello","rank":1,"pid":3,"identity":""}',
     b'{"op":"failed","rank":1,"error":5}', b'{"op":"shutdown"}', b'{"op":"ping"}',
     ('{"op":"release","rid":"' + "\u00e9" * 300 + '"}').encode(),
    ]
    for p in C:
        seen.append(repr(("control", p, *_run(control.decode, p))))
    for p in C[3:9]:
        seen.append(repr(("control-vocab", p, *_run(lambda x: control.decode(x, 2), p))))
    seen.append(repr(("control-reply", b"[", *_run(control.read_reply, b"["))))
    seen.append(repr(("control-reply", b"[1]", *_run(control.read_reply, b"[1]"))))

    def bj(d): return json.dumps(d).encode()
    B = [b"\xff", b"[1]", bj({"msg": "query"}), bj({"protocol": True, "msg": "query"}), bj({"protocol": 2, "msg": "zz"}),
         bj({"protocol": 2, "msg": "query", "x": 1}), bj({"protocol": 2, "msg": "info", "mlxcel": "1"}),
         bj({"protocol": 2, "msg": "info", "mlxcel": 1, "memory": True}), bj({"protocol": 2, "msg": "info", "mlxcel": "1", "memory": -1}),
         bj({"protocol": 2, "msg": "refused", "reason": "x" * 2000, "fatal": 1}),
         bj({"protocol": 2, "msg": "offer", "mlxcel": "1", "cluster": "c", "model_identity": "m", "stage": 0, "stages": 1, "node_id": "n",
             "layers": [2, 1], "memory": [0], "coordinator": "c", "toml": "t"}),
         bj({"protocol": 2, "msg": "offer", "mlxcel": "1", "cluster": "c", "model_identity": "m", "stage": 0, "stages": 1, "node_id": "n",
             "layers": [0, 1], "memory": [1], "coordinator": "c", "toml": "t"}),
         bj({"protocol": 2, "msg": "refused", "reason": "r", "fatal": False}), b"x" * 70000]
    for p in B:
        seen.append(repr(("bringup", p[:200], *_run(bm.decode, p))))
    for kw in [dict(kind="refused", reason="r", fatal=1), dict(kind="info", mlxcel="1"), dict(kind="refused", reason="y" * 3000, fatal=True)]:
        kind = kw.pop("kind")
        seen.append(repr(("bringup-encode", kind, *_run(lambda _: bm.encode(kind, **kw), None))))

    N = "0123456789abcdef"
    GOOD = {"max_tokens": 3}
    gen = lambda d: dm.Generate.parse({"nonce": N, "prompt": [1], "params": GOOD, **d}, 8, 50)
    G = [{"nonce": "x"}, {"prompt": []}, {"prompt": [True]}, {"prompt": [60]}, {"decode_target": "a:b"}, {"top_logprobs": 21},
         {"top_logprobs": True}, {"ignore_eos": 1}, {"params": None}, {"params": {}}, {"params": {"max_tokens": True}},
         {"params": {"max_tokens": 0}}, {"params": {"max_tokens": 2**31 + 1}}, {"params": {"max_tokens": 3, "temperature": "hot"}},
         {"params": {"max_tokens": 3, "temperature": float("nan")}}, {"params": {"max_tokens": 3, "temperature": True}},
         {"params": {"max_tokens": 3, "temperature": 5}}, {"params": {"max_tokens": 3, "top_p": 0}},
         {"params": {"max_tokens": 3, "top_k": -1}}, {"params": {"max_tokens": 3, "top_k": 1.0}},
         {"params": {"max_tokens": 3, "seed": 1.5}}, {"params": {"max_tokens": 3, "seed": 2**63}}, {"params": {"max_tokens": 3, "seed": None}},
         {"params": {"max_tokens": 3, "stop": "x"}}, {"params": {"max_tokens": 3, "stop": [1]}}, {"params": {"max_tokens": 3, "stop": [""]}},
         {"params": {"max_tokens": 3, "stop": ["a"] * 5}}, {"params": {"max_tokens": 3, "logprobs": 1}},
         {"params": {"max_tokens": 3, "mirostat": 1, "a": 2}}, {"params": [1]}, {}]
    for d in G:
        seen.append(repr(("disagg-generate", repr(d), *_run(gen, d))))
    fin = lambda d: dm.Finish.parse({"nonce": N, "reason": "stop", "text": "", "prompt_tokens": 1, "completion_tokens": 1, **d})
    for d in [{"reason": "x"}, {"text": 5}, {"text": None}, {"prompt_tokens": -1}, {"completion_tokens": True}, {"error": 5}, {"code": "x"},
              {"code": 70000}, {"code": None}, {"code": 4}, {"error": "e" * 70000}]:
        seen.append(repr(("disagg-finish", repr(d)[:100], *_run(fin, d))))
    err = lambda d: dm.Error.parse({"nonce": N, "code": 4, "message": "m", **d})
    for d in [{"code": None}, {"code": True}, {"message": None}, {"node": "x" * 65}, {"node": None}, {"node": 5}]:
        seen.append(repr(("disagg-error", repr(d), *_run(err, d))))
    ho = lambda d: dm.HandedOff.parse({"nonce": N, "bytes": 1, "seconds": 0.5, **d})
    for d in [{"bytes": -1}, {"seconds": None}, {"seconds": True}, {"decode": 5}, {"prefill_seconds": "x"}, {"decode": None}]:
        seen.append(repr(("disagg-handedoff", repr(d), *_run(ho, d))))
    tk = lambda d: dm.Tokens.parse({"nonce": N, "events": [[1, "a", None, []]], **d})
    for d in [{"events": []}, {"events": [[1, "a"]]}, {"events": [[True, "a", None, []]]}, {"events": [[1, 5, None, []]]},
              {"events": [[1, "a", "x", []]]}, {"events": [[1, "a", None, [[1]]]]}, {"events": [[1, "a", None, [[True, 0.5]]]]},
              {"events": [[1, "a", None, [[1, True]]]]}, {"events": [[1, "a", None, [[1, 0.5]] * 21]]}, {"events": [[2**32, "a", None, []]]}]:
        seen.append(repr(("disagg-tokens", repr(d)[:100], *_run(tk, d))))
    hm = lambda d: dm.HandoffMeta.parse({"nonce": N, "router": "127.0.0.1:1", "params": GOOD, "first": [1, "a", None, []], **d}, 50)
    for d in [{"router": "x"}, {"first": [60, "a", None, []]}, {"draws": 2}, {"top_logprobs": -1}, {"ignore_eos": None}]:
        seen.append(repr(("disagg-meta", repr(d), *_run(hm, d))))
    seen.append(repr(("disagg-decode", b"", *_run(dm.decode, b""))))
    seen.append(repr(("disagg-decode", b"\x01{", *_run(dm.decode, b"\x01{"))))
    seen.append(repr(("disagg-decode", b"\x01[]", *_run(dm.decode, b"\x01[]"))))
    seen.append(repr(("disagg-decode", b"\xee{}", *_run(dm.decode, b"\xee{}"))))

    P = [None, [1], {"x": 1, "y": 2}, {"temperature": "a"}, {"temperature": True}, {"temperature": float("inf")}, {"temperature": 3},
         {"top_p": None}, {"top_p": 0}, {"top_k": 1.0}, {"top_k": True}, {"top_k": -1}, {"top_k": 2**40}, {"seed": "1"}, {"seed": True},
         {"seed": 2**70}, {"logprobs": 1}, {"top_logprobs": 21}, {"top_logprobs": True}, {"max_tokens": 3}, {"stop": []}, {}]
    for d in P:
        seen.append(repr(("pipeline-params", repr(d), *_run(pp.params_from_wire, d))))
    for raw in [None, 5, [True], [1] * 3, [100]]:
        seen.append(repr(("pipeline-tokens", repr(raw), *_run(lambda r: pp.tokens_from_wire(r, "prompt", 50), raw))))
    for raw in [True, -1, 6, 2.0, 3]:
        seen.append(repr(("pipeline-count", repr(raw), *_run(lambda r: pp.count_from_wire(r, "cached", 5), raw))))
    ST = {"layers": [0, 2]}
    for d in [{"stage": -1}, {"num_layers": 0}, {"steps": True}, {"read_s": -1}, {"read_s": True}, {"read_s": float("nan")}, {"layers": [0]},
              {"layers": [0, True]}, {"draining": 1}, {}]:
        seen.append(repr(("pipeline-state", repr(d), *_run(pr.check_state, {**ST, **d}))))

    return seen


def test_every_refusal_text_is_unchanged():
    seen = observed()
    if os.environ.get("MLXCEL_REGEN_CODEC_TEXTS"):
        GOLDEN.write_text("\n".join(seen) + "\n")
    assert seen == GOLDEN.read_text().splitlines()
