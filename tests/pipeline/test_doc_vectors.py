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
