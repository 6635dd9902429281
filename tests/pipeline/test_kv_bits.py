"""``mlxcel generate --kv-bits`` through the real CLI: in-process pipeline stages with a quantized KV cache give the
one-device quantized text exactly (and 4 bits is not full precision on this checkpoint: the flag took effect)."""

from __future__ import annotations

import pytest

from tests.cli_in_process import run_mlxcel as mlxcel
from tests.commands.test_cli import assert_one_line_error
from tests.engine.test_kv_bits import make_llama

Q4 = ("--kv-bits", "4", "--kv-group-size", "32")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_llama(tmp_path_factory, "kv-pp-llama")


def generated(model, *flags: str) -> str:
    result = mlxcel("generate", "-m", str(model), "-p", "hello there", "--raw", "-n", "24", *flags)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_two_stages_with_kv_bits_equal_one_device_with_kv_bits(llama_dir):
    one = generated(llama_dir, *Q4)
    assert generated(llama_dir, *Q4, "--pp-size", "2") == one
    assert generated(llama_dir) != one


def test_kv_flags_are_refused_by_name(llama_dir, tmp_path):
    from mlxcel.models.random_checkpoint import make_random_checkpoint

    assert_one_line_error(mlxcel("generate", "-m", str(llama_dir), "-p", "hi", "--kv-group-size", "32"),
                          "--kv-group-size needs --kv-bits")
    assert_one_line_error(mlxcel("generate", "-m", str(llama_dir), "-p", "hi", "--kv-bits", "8"),
                          "--kv-group-size 64: llama's head width 32 is not a whole number of groups")
    gemma = make_random_checkpoint(tmp_path, family="gemma3_text", layers=2, hidden=128, heads=4, kv_heads=2)
    assert_one_line_error(mlxcel("generate", "-m", str(gemma), "-p", "hi", "--kv-bits", "8", "--pp-size", "2"),
                          "gemma3_text's layer 0 keeps a RotatingKVCache, which mlx-lm cannot quantize")
    bad = mlxcel("generate", "-m", str(llama_dir), "-p", "hi", "--kv-bits", "3")
    assert bad.returncode != 0 and "--kv-bits: invalid choice: 3 (choose from 4, 8)" in bad.stderr
