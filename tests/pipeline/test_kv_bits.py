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


def quantized_reference(model_dir, prompt: list[int], n: int, bits: int | None) -> str:
    """One device's greedy text with a ``bits``-bit KV cache (None: full precision), in this process."""
    from mlxcel.engine.generate import generate_tokens, make_cache
    from mlxcel.engine.kv_quant import KVQuant, use_kv_bits
    from mlxcel.engine.sampling import SamplingParams, make_sampler
    from mlxcel.models.loading import load_checkpoint

    loaded = load_checkpoint(model_dir)
    use_kv_bits(loaded.model, KVQuant(bits, 32) if bits else None)
    forward = lambda x, c: loaded.model(x, cache=c)  # noqa: E731
    detok = loaded.tokenizer.detokenizer
    for t, _ in generate_tokens(forward, prompt, make_cache(loaded.model), make_sampler(SamplingParams()), n):
        detok.add_token(t)
    detok.finalize()
    return detok.text


@pytest.mark.proc
@pytest.mark.timeout(180)
def test_a_remote_pipeline_whose_toml_sets_kv_bits_equals_one_device_with_them(tmp_path_factory, llama_dir):
    """Two stage processes and a coordinator on loopback, [pipeline] kv_bits = 4: concurrent requests (batched on
    every stage) give one device's 4-bit text, which is not the full-precision text."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.pipeline.cluster import LocalCluster
    from tests.pipeline.test_remote import remote_tokens

    prompts, n = [[1, 40, 41, 42, 43, 44], [1, 50, 51]], 16
    cluster = LocalCluster(tmp_path_factory.mktemp("kv-pp"), llama_dir,
                           pipeline="kv_bits = 4\nkv_group_size = 32").start()
    try:
        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(lambda p: remote_tokens(cluster.url, p, n), prompts))
    finally:
        cluster.stop()
    assert got == [quantized_reference(llama_dir, p, n, 4) for p in prompts]
    assert got != [quantized_reference(llama_dir, p, n, None) for p in prompts]
