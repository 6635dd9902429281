"""``mlxcel generate --tp-size 2 --kv-bits``: every rank quantizes its share of the KV cache (rank 0's setting), and
the text equals one device's with the same --kv-bits."""

from __future__ import annotations

import pytest

from tests.engine.test_kv_bits import make_llama
from tests.parallel.test_generate import generate

pytestmark = [pytest.mark.timeout(180), pytest.mark.proc]
Q4 = ("--kv-bits", "4", "--kv-group-size", "32")


def test_tp2_with_kv_bits_equals_one_device_with_kv_bits(tmp_path_factory):
    model = make_llama(tmp_path_factory, "kv-tp-llama")
    single = generate(model, *Q4, n=24)
    sharded = generate(model, "--tp-size", "2", *Q4, n=24)
    assert sharded.stdout == single.stdout and "over 2 ranks" in sharded.stderr
    assert generate(model, n=24).stdout != single.stdout  # 4 bits took effect on every rank
