"""docs/pipeline.md's worked RUN_ENTRY decodes to what the text says and re-encodes to the same bytes."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from mlxcel.pipeline.protocol import MsgType, check_ids, decode, encode

DOC = Path(__file__).resolve().parents[2] / "docs" / "pipeline.md"


def vectors() -> dict[str, bytes]:
    block = re.search(r"```stage-vector\n(.*?)```", DOC.read_text(), re.S)
    assert block, "docs/pipeline.md lost its stage-vector block"
    return {k.strip(): bytes.fromhex(v.strip()) for k, v in (line.split("=", 1) for line in block.group(1).splitlines() if line.strip())}


def test_the_documented_run_entry_round_trips():
    raw = vectors()["run_entry"]
    msg = decode(raw)
    assert msg.type is MsgType.RUN_ENTRY
    assert msg.header == {"nonce": "5f0c3a9e12d47b68", "phase": "decode", "micro_batch": 0,
                          "request_ids": ["req-7"], "sample": True}
    ids = check_ids(msg, max_rows=8, vocab_size=49152)
    assert ids.tolist() == [[504]]
    again = encode(MsgType.RUN_ENTRY, msg.header, {"input_ids": ("int32", np.array([[504]], dtype=np.int32))})
    assert again == raw


def test_the_documented_run_result_round_trips():
    raw = vectors()["run_result"]
    msg = decode(raw)
    assert msg.type is MsgType.RUN_RESULT and msg.tensors == {}
    assert msg.header == {"nonce": "5f0c3a9e12d47b68", "phase": "decode", "micro_batch": 0, "request_ids": ["req-7"],
                          "sample": True, "tokens": [3575], "logprobs": None, "top_logprobs": None}
    assert encode(MsgType.RUN_RESULT, msg.header) == raw


# -- the wire cost of a token (docs/pipeline.md §3.10 and §6, README), recomputed from the codec -----

README = DOC.parents[1] / "README.md"
STEP = {"nonce": "5f0c3a9e12d47b68", "phase": "decode", "micro_batch": 0, "request_ids": ["req-7"], "sample": True}


def _sizes() -> dict[str, int]:
    """Payload bytes of one decoded token's messages for the default model (hidden 576, vocab 49152)."""
    return {
        "entry": len(encode(MsgType.RUN_ENTRY, STEP, {"input_ids": ("int32", np.array([[504]], np.int32))})),
        "activation": len(encode(MsgType.ACTIVATION, STEP, {"hidden": ("float32", np.zeros((1, 1, 576), np.float32))})),
        "tokens": len(encode(MsgType.RUN_RESULT, {**STEP, "tokens": [3575]})),
        "logits": len(encode(MsgType.RUN_RESULT, {**STEP, "tokens": None},
                             {"logits": ("float32", np.zeros((1, 49152), np.float32))})),
    }


def test_the_documented_wire_cost_is_the_codec_s():
    from mlxcel.cluster.wire import FRAME_OVERHEAD

    s, text = _sizes(), DOC.read_text()
    framed = {k: v + FRAME_OVERHEAD for k, v in s.items()}
    token = framed["entry"] + framed["activation"] + framed["tokens"]
    logits = framed["entry"] + framed["activation"] + framed["logits"]
    section = text[text.index("## 6. What a decoded token costs"):text.index("## 7.")]
    for row in (f"| RUN_ENTRY, 1 row | {s['entry']:,} B | {framed['entry']:,} B |",
                f"| {s['activation']:,} B | {framed['activation']:,} B |",
                f"| RUN_RESULT, token return | {s['tokens']:,} B | {framed['tokens']:,} B |",
                f"**{token:,} B in 3 frames**", f"| {s['logits']:,} B | {framed['logits']:,} B |",
                f"{logits:,} B in 3 frames"):
        assert row in section, f"docs/pipeline.md §6 lost or misstates {row!r}"
    sizes_310 = (f"| RUN_RESULT size (1 row, default model; payload, then frame) | {s['tokens']:,} B, "
                 f"{framed['tokens']:,} B | {s['logits']:,} B, {framed['logits']:,} B |")
    assert sizes_310 in text, "docs/pipeline.md §3.10's RUN_RESULT sizes are stale"
    assert f"three frames and {token:,} B" in README.read_text().replace("\n", " "), "README's bytes per token are stale"


def test_the_docs_describe_the_binary_step_header_not_json_fields():
    """§3.8 and §4.3 described JSON of the old header: a `tokens: null` on the wire, an absent micro_batch."""
    text = DOC.read_text()
    assert "`tokens: null`" not in text and "(absent: 0)" not in text
    nothing = encode(MsgType.RUN_RESULT, {**STEP, "phase": "prefill", "sample": False, "tokens": None})
    assert nothing[-1] == 0 and decode(nothing).header["tokens"] is None  # result kind 0, read back as null
