"""Refusals before any weight is read: shapes that do not divide, families, modes, hostfiles, flags."""

from __future__ import annotations

import json
import logging
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mlxcel.cli import build_parser
from mlxcel.commands.serve import serve_config
from mlxcel.cluster.errors import SecretError
from mlxcel.parallel.errors import HostfileError, ShardRefusal, TPError
from mlxcel.parallel.options import TPFlags, prepare_tp
from mlxcel.parallel.plan import check_shardable

pytestmark = pytest.mark.proc  # starts processes (tests/proc_marker.py)

CLI = [sys.executable, "-m", "mlxcel"]
SMOLLM2 = {"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
           "num_key_value_heads": 3, "head_dim": 64}


def test_default_model_shape_shards_over_3_not_2():
    plan = check_shardable(SMOLLM2, 3, "smollm2")
    assert plan.describe() == "llama over 3 ranks: 3 of 9 heads, 1 of 3 KV heads, 512 of 1536 MLP columns per rank"
    with pytest.raises(ShardRefusal) as err:
        check_shardable(SMOLLM2, 2, "smollm2")
    assert str(err.value) == ("smollm2 does not shard across 2 ranks: attention heads (9) is not divisible by 2 "
                              "(this model has 9 attention heads, 3 KV heads, intermediate size 1536; "
                              "--tp-size values that work: 1, 3)")


@pytest.mark.parametrize("config,size,dimension", [
    ({"num_attention_heads": 6, "num_key_value_heads": 3, "intermediate_size": 96}, 2, "KV heads (3)"),
    ({"num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 90}, 4, "intermediate size (90)"),
    ({"num_attention_heads": 8, "intermediate_size": 96}, 3, "attention heads (8)"),
])
def test_each_dimension_is_named(config, size, dimension):
    with pytest.raises(ShardRefusal, match="^" + re.escape(f"m does not shard across {size} ranks: {dimension} is "
                                                           f"not divisible by {size} ")):
        check_shardable({"model_type": "qwen3", "hidden_size": 64, **config}, size, "m")


def test_quantized_shares_must_be_whole_groups():
    config = {**SMOLLM2, "num_attention_heads": 6, "num_key_value_heads": 6, "head_dim": 32,
              "intermediate_size": 96 * 6, "quantization": {"group_size": 64, "bits": 4}}
    assert check_shardable(config, 3).size == 3  # 192 and 192 per rank: 3 groups each
    with pytest.raises(ShardRefusal, match=r"attention output width .* \(192 / 6 = 32\) is not a whole number of "
                                           r"quantization groups of 64"):
        check_shardable(config, 6)


def test_unsupported_families_are_refused():
    from mlxcel.commands.support import family_config

    with pytest.raises(ShardRefusal, match=r"^m: model family 'gpt2' is not supported by tensor parallelism: it has "
                                           r"no row and the plain-layout rule refuses it: mlx-lm cannot build it"):
        check_shardable({**SMOLLM2, "model_type": "gpt2"}, 3, "m")
    with pytest.raises(ShardRefusal, match=r"^m: model family 'phi3' is not supported by tensor parallelism: .* "
                                           r"fused QKV projection"):
        check_shardable({**family_config("phi3"), "model_type": "phi3"}, 2, "m")
    # no shard() in mlx-lm, but the plain layout: by rule (tests/parallel/test_tp_rule.py)
    plan = check_shardable({**SMOLLM2, "model_type": "mixtral", "num_local_experts": 3}, 3, "m")
    assert plan.describe() == "mixtral (by rule) over 3 ranks: 3 of 9 heads, 1 of 3 KV heads, 1 of 3 experts per rank"


def _prepare(model: Path, *flags: str):
    args = build_parser().parse_args(["generate", "-m", str(model), "-p", "x", *flags])
    config = json.loads((model / "config.json").read_text())
    tp = TPFlags.from_cli_args(vars(args))
    tp.check(pp_layers=args.pp_layers, pp_size=args.pp_size)  # the command's one check, then what needs config.json
    return prepare_tp(tp, model, config)


def secret_file(tmp_path: Path) -> Path:
    path = tmp_path / "secret"
    path.write_text("s" * 32)
    path.chmod(0o600)
    return path


def _hostfile(tmp_path: Path, *ips: str, as_object: bool = True) -> Path:
    hosts = [{"ssh": f"h{i}", "ips": [ip]} for i, ip in enumerate(ips)]
    path = tmp_path / "hosts.json"
    path.write_text(json.dumps({"backend": "ring", "hosts": hosts} if as_object else hosts))
    return path


def test_hostfile_with_a_non_loopback_address_is_refused(tiny_6_3, tmp_path):
    hosts = _hostfile(tmp_path, "127.0.0.1", "10.0.0.2", "127.0.0.3")
    with pytest.raises(HostfileError) as err:
        _prepare(tiny_6_3, "--tp-size", "3", "--tp-hostfile", str(hosts))
    assert str(err.value) == (f"{hosts} names non-loopback addresses 10.0.0.2 (rank 1): MLX's collectives carry "
                              "tensors over plain, unauthenticated TCP, so tensor parallelism binds loopback only; "
                              "pass --tp-allow-plaintext-network to accept that risk")


def test_plaintext_flag_accepts_the_hostfile_with_a_warning(tiny_6_3, tmp_path, caplog):
    hosts = _hostfile(tmp_path, "127.0.0.1", "10.0.0.2", "127.0.0.3")
    with caplog.at_level(logging.WARNING, logger="mlxcel.parallel"):
        tp = _prepare(tiny_6_3, "--tp-size", "3", "--tp-hostfile", str(hosts), "--tp-rank", "1",
                      "--tp-allow-plaintext-network", "--cluster-secret-file", str(secret_file(tmp_path)))
    assert (tp.size, tp.rank, tp.port, tp.local) == (3, 1, 32323, False)
    assert tp.hostfile.ring_addresses(32323) == [["127.0.0.1:32323"], ["10.0.0.2:32324"], ["127.0.0.3:32325"]]
    assert tp.hostfile.control_address(32323) == ("127.0.0.1", 32326)
    assert any("plain, unauthenticated TCP" in r.getMessage() for r in caplog.records)


def test_loopback_hostfile_needs_no_flag_and_no_warning(tiny_6_3, tmp_path, caplog):
    hosts = _hostfile(tmp_path, "127.0.0.1", "127.0.0.2", "::1", as_object=False)
    with caplog.at_level(logging.WARNING, logger="mlxcel.parallel"):
        tp = _prepare(tiny_6_3, "--tp-size", "3", "--tp-hostfile", str(hosts), "--tp-port", "4000",
                      "--cluster-secret-file", str(secret_file(tmp_path)))
    assert tp.hostfile.ring_addresses(tp.port)[2] == ["[::1]:4002"] and not caplog.records


def test_hostfile_without_a_cluster_secret_is_refused(tiny_6_3, tmp_path, monkeypatch):
    monkeypatch.delenv("MLXCEL_CLUSTER_SECRET", raising=False)
    monkeypatch.delenv("MLXCEL_CLUSTER_SECRET_FILE", raising=False)
    hosts = _hostfile(tmp_path, "127.0.0.1", "127.0.0.2", "127.0.0.3")
    for rank in ("0", "1"):  # the tp and tp-rank roles' configure hooks, before anything is bound
        args = build_parser().parse_args(["serve", "-m", str(tiny_6_3), "--tp-size", "3", "--tp-hostfile", str(hosts),
                                          "--tp-rank", rank])
        with pytest.raises(SecretError, match="a cluster secret is required but none was configured"):
            serve_config(args)


@pytest.mark.parametrize("content,message", [
    ("[", "not JSON"),
    ("[]", "expected a non-empty list of hosts"),
    ('[{"ssh": "a"}, {"ssh": "b"}, {"ssh": "c"}]', 'host 0 has no "ips"'),
    ('[{"ips": ["a.example"]}, {"ips": ["127.0.0.1"]}, {"ips": ["127.0.0.1"]}]', "'a.example' is not an IP address"),
    ('[{"ips": ["127.0.0.1"]}, {"ips": ["127.0.0.1"]}]', "lists 2 hosts but --tp-size is 3"),
])
def test_malformed_hostfiles(tiny_6_3, tmp_path, content, message):
    path = tmp_path / "h.json"
    path.write_text(content)
    with pytest.raises(HostfileError, match=message):
        _prepare(tiny_6_3, "--tp-size", "3", "--tp-hostfile", str(path))


@pytest.mark.parametrize("flags,message", [
    (["--tp-embedding-mode", "vocab_parallel"], "--tp-embedding-mode vocab_parallel is not supported: this runtime "
                                                "keeps the embedding table replicated on every rank"),
    (["--tp-size", "3", "--tp-lm-head-mode", "vocab_parallel"], "--tp-lm-head-mode vocab_parallel is not supported"),
    (["--tp-rank", "1"], "--tp-rank needs --tp-size above 1"),
    (["--tp-size", "3", "--tp-rank", "1"], "--tp-rank needs --tp-hostfile"),
    (["--tp-size", "3", "--tp-allow-plaintext-network"], "--tp-allow-plaintext-network needs a --tp-hostfile"),
    (["--tp-size", "3", "--pp-size", "2"], "--tp-size 3 cannot be combined with --pp-size 2"),
])
def test_flag_combinations(tiny_6_3, flags, message):
    with pytest.raises(TPError, match=message):
        _prepare(tiny_6_3, *flags)


def test_tp_size_1_is_off(tiny_6_3):
    assert _prepare(tiny_6_3) is None


@pytest.fixture(scope="module")
def unreadable_weights(tiny_6_3, tmp_path_factory) -> Path:
    """The 6/3 checkpoint with garbage weights: any refusal printed for it came before reading them."""
    model = tmp_path_factory.mktemp("garbage") / "m"
    shutil.copytree(tiny_6_3, model)
    for f in model.glob("*.safetensors"):
        f.write_bytes(b"not a safetensors file")
    return model


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *argv], capture_output=True, text=True, timeout=60)


def test_generate_refuses_before_loading_weights(unreadable_weights):
    out = _run("generate", "-m", str(unreadable_weights), "-p", "hi", "--tp-size", "2")
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr == (f"mlxcel: error: {unreadable_weights} does not shard across 2 ranks: KV heads (3) is not "
                          "divisible by 2 (this model has 6 attention heads, 3 KV heads, intermediate size 96; "
                          "--tp-size values that work: 1, 3)\n")


def test_default_model_is_refused_at_tp_2(default_model):
    out = _run("generate", "-m", str(default_model), "-p", "hi", "--tp-size", "2")
    assert (out.returncode, out.stdout) == (1, "")
    assert out.stderr.startswith(f"mlxcel: error: {default_model} does not shard across 2 ranks: attention heads (9) "
                                 "is not divisible by 2") and len(out.stderr.splitlines()) == 1


def test_server_refuses_before_loading_weights_or_binding(unreadable_weights, tmp_path):
    hosts = _hostfile(tmp_path, "127.0.0.1", "192.168.7.7", "127.0.0.1")
    start = time.monotonic()
    out = _run("serve", "-m", str(unreadable_weights), "--tp-size", "3", "--tp-hostfile", str(hosts),
               "--port", "1")  # a port it could not bind: the refusal comes first
    assert out.returncode == 1
    assert out.stderr.splitlines() == [f"mlxcel: error: {hosts} names non-loopback addresses 192.168.7.7 (rank 1): "
                                       "MLX's collectives carry tensors over plain, unauthenticated TCP, so tensor "
                                       "parallelism binds loopback only; pass --tp-allow-plaintext-network to "
                                       "accept that risk"]
    assert time.monotonic() - start < 30


@pytest.mark.parametrize("argv", [["generate", "--help"], ["serve", "--help"]])
def test_help_names_the_supported_families(argv):
    text = " ".join(_run(*argv).stdout.split())
    from mlxcel.parallel.families import FAMILIES

    assert "--tp-size N" in text and "Families: " + ", ".join(FAMILIES) in text
    assert "expert_parallel = E/N whole experts per rank" in text and "within_expert = every expert" in text
