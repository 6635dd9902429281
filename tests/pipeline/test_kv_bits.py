"""``mlxcel generate --kv-bits`` through the real CLI: in-process pipeline stages with a quantized KV cache give the
one-device quantized text exactly (and 4 bits is not full precision on this checkpoint: the flag took effect)."""

from __future__ import annotations

import re

import pytest

from mlxcel.topology.cluster_config import ClusterConfigError, load_cluster_config
from tests.cli_in_process import run_mlxcel as mlxcel
from tests.commands.test_cli import assert_one_line_error
from tests.engine.test_kv_bits import make_llama
from tests.pipeline.cluster_toml import COORDINATOR_AND_STAGE_0, write_toml

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


TOML = """
[cluster]
name = "kv"
[pipeline]
{pipeline}
""" + COORDINATOR_AND_STAGE_0 + 'layers = "0-3"\n'


@pytest.mark.parametrize("pipeline,why", [
    ("kv_bits = 3", "kv_bits under [pipeline] must be one of 4, 8, got 3"),
    ("kv_bits = true", "kv_bits under [pipeline] must be one of 4, 8, got True"),
    ("kv_bits = 8\nkv_group_size = 16", "kv_group_size under [pipeline] must be one of 32, 64, 128, got 16"),
    ("kv_group_size = 32", "kv_group_size under [pipeline] needs kv_bits"),
])
def test_the_tomls_kv_keys_are_bounded(tmp_path, pipeline, why):
    with pytest.raises(ClusterConfigError, match=re.escape(why)):
        load_cluster_config(write_toml(tmp_path, TOML.format(pipeline=pipeline)))


def test_a_stage_takes_the_tomls_kv_bits_or_its_own_flag_and_refuses_both_differing(tmp_path, llama_dir):
    from mlxcel.entrypoints.stage import stage_kv_bits
    from mlxcel.errors import CLIError
    from mlxcel.server.runtime import ServerConfig

    plain = load_cluster_config(write_toml(tmp_path, TOML.format(pipeline="")))
    toml = load_cluster_config(write_toml(tmp_path, TOML.format(pipeline="kv_bits = 4\nkv_group_size = 32")))
    flag = ServerConfig(model=llama_dir, served_model_name="t", kv_bits=8, kv_group_size=32)
    none = ServerConfig(model=llama_dir, served_model_name="t")
    assert (stage_kv_bits(flag, plain).kv_bits, stage_kv_bits(none, plain).kv_bits) == (8, None)
    assert (stage_kv_bits(none, toml).kv_bits, stage_kv_bits(none, toml).kv_group_size) == (4, 32)
    with pytest.raises(CLIError, match="--kv-bits 8 --kv-group-size 32 differs from .*kv_bits = 4, kv_group_size = 32"):
        stage_kv_bits(flag, toml)
