"""docs/protocol.md stays complete: every TransportOptions field and every error code is documented."""

from __future__ import annotations

import dataclasses
import enum
import re
from pathlib import Path

from mlxcel.cluster.transport import TransportOptions
from mlxcel.cluster.wire import ErrorCode

DOC = (Path(__file__).resolve().parents[2] / "docs" / "protocol.md").read_text()


def _section(title: str) -> str:
    start = DOC.index(title)
    end = DOC.find("\n## ", start + 1)
    nxt = DOC.find("\n### ", start + 1)
    return DOC[start : min(x for x in (end, nxt) if x > 0)]


def _first_cells(section: str) -> list[str]:
    return re.findall(r"^\| `?([A-Za-z_0-9]+)`? \|", section, re.M)


def test_every_transport_option_is_documented_with_its_default():
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(\w+)` \| ([^|]+) \|", _section("### 8.3"), re.M)}
    fields = dataclasses.fields(TransportOptions)
    assert set(rows) == {f.name for f in fields}
    for f in fields:
        default, cell = f.default, rows[f.name].strip()
        if isinstance(default, enum.Enum):
            assert cell == f"`{type(default).__name__}.{default.name}`", f.name
        elif isinstance(default, bool) or default is None:
            assert cell == str(default), f.name
        elif f.name == "seq_limit":
            assert default == 2**96 and cell == "2^96"
        else:
            assert re.match(rf"{default:g}\b|{default}\b", cell), (f.name, cell)


def test_every_error_code_is_documented():
    table = re.findall(r"^\| (\d+) \| ([A-Z_]+) \|", _section("### 5.1"), re.M)
    assert [(int(v), n) for v, n in table] == [(int(c), c.name) for c in ErrorCode]
