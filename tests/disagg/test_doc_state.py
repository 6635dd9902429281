"""docs/disagg.md's STATE row gives the RPC request body as the router sends it: the type byte, then `{}`."""

from __future__ import annotations

import re
from pathlib import Path

from mlxcel.disagg.messages import decode, encode
from mlxcel.disagg.wire import MsgType

DOC = Path(__file__).resolve().parents[2] / "docs" / "disagg.md"


def test_the_documented_state_request_body_is_what_the_router_sends():
    row = next(line for line in DOC.read_text().splitlines() if line.startswith("| `0x07` | STATE |"))
    m = re.search(r"RPC request body `0x07\{\}`: .* the 3 bytes `([0-9a-f ]+)`", row)
    assert m, row
    body = bytes.fromhex(m.group(1))
    assert body == encode(MsgType.STATE, {}) == b"\x07{}"
    assert decode(body) == (MsgType.STATE, {})
