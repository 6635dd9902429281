"""The tensor-parallel control channel bounds its ids in UTF-8 bytes, like every other protocol (issue 21)."""

from __future__ import annotations

import pytest

from mlxcel.config import TP_MAX_CONTROL_TEXT
from mlxcel.parallel.control import ControlError, decode, encode


def test_a_rid_of_the_bound_in_bytes_passes():
    rid = "é" * (TP_MAX_CONTROL_TEXT // 2)  # 1024 bytes
    assert decode(encode("release", rid=rid, tokens=None))["rid"] == rid


@pytest.mark.parametrize("rid", ["é" * (TP_MAX_CONTROL_TEXT // 2 + 1), "r" * (TP_MAX_CONTROL_TEXT + 1), ""])
def test_a_rid_over_the_bound_in_bytes_is_refused(rid):
    with pytest.raises(ControlError, match="UTF-8 bytes"):
        decode(encode("release", rid=rid, tokens=None))
