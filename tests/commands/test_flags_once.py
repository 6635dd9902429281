"""Typed flags, checked once; the cluster secret loaded once per process and held once, never in a repr."""

from __future__ import annotations

import logging
from dataclasses import fields
from pathlib import Path

import pytest

import mlxcel.cluster.secret as secret_module
import mlxcel.topology.distributed as distributed_module
from mlxcel.cli import build_parser
from mlxcel.commands.serve import as_flags, serve_config
from mlxcel.disagg.flags import DisaggFlags, NodeConfig
from mlxcel.errors import CLIError
from mlxcel.parallel.options import TPFlags
from mlxcel.entrypoints.flags import ServeFlags
from mlxcel.topology.distributed import Distributed
from tests.pipeline.cluster_toml import COORDINATOR_AND_STAGE_0, write_toml

SECRET = b"q" * 32
STAGE_1 = '[[nodes]]\nid = "stage-1"\nrole = "stage"\naddress = "127.0.0.4:19002"\n'


@pytest.fixture(autouse=True)
def no_secret_in_environment(monkeypatch):
    monkeypatch.delenv("MLXCEL_CLUSTER_SECRET", raising=False)
    monkeypatch.delenv("MLXCEL_CLUSTER_SECRET_FILE", raising=False)


@pytest.fixture()
def secret_path(tmp_path: Path) -> Path:
    path = tmp_path / "cluster.secret"
    path.write_bytes(SECRET)
    path.chmod(0o600)
    return path


@pytest.fixture()
def counted(monkeypatch):
    """Every call of the secret loader and of the two checks that once ran twice per start."""
    calls: dict[str, int] = {"load_secret": 0, "disagg": 0, "tp": 0}

    def wrap(owner, name, key):
        real = getattr(owner, name)

        def counting(*args, **kwargs):
            calls[key] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, counting)

    wrap(secret_module, "load_secret", "load_secret")
    wrap(distributed_module, "load_secret", "load_secret")
    wrap(DisaggFlags, "check", "disagg")
    wrap(TPFlags, "check", "tp")
    return calls


def config_of(*argv: str):
    return serve_config(build_parser().parse_args(["serve", "--no-warmup", *argv]))


def test_a_router_loads_the_secret_once_holds_it_once_and_checks_its_flags_once(tiny_llama, secret_path, counted,
                                                                                caplog):
    with caplog.at_level(logging.DEBUG):
        config = config_of("-m", str(tiny_llama), "--node-role", "router", "--serving-bind", "127.0.0.40:19999",
                           "--prefill-peers", "127.0.0.41:1", "--decode-peers", "127.0.0.42:2",
                           "--cluster-secret-file", str(secret_path))
    assert counted == {"load_secret": 1, "disagg": 1, "tp": 1}
    assert config.role == "router" and config.secret.reveal() == SECRET
    assert "secret" not in {f.name for f in fields(NodeConfig)}  # one holder: ServeConfig.secret
    for text in (repr(config), str(config), caplog.text):
        assert "secret=" not in text and SECRET.decode() not in text


def test_a_cluster_stage_loads_the_secret_once_and_its_node_holds_none(tmp_path, tiny_llama, secret_path, counted):
    toml = write_toml(tmp_path, "[cluster]\npipeline_parallel_size = 2\n" + COORDINATOR_AND_STAGE_0 + STAGE_1)
    config = config_of("-m", str(tiny_llama), "--distributed-config", str(toml), "--node-id", "stage-1",
                       "--cluster-secret-file", str(secret_path))
    assert config.role == "stage" and counted["load_secret"] == 1 and config.secret.reveal() == SECRET
    assert "secret" not in {f.name for f in fields(Distributed)}
    assert "secret=" not in repr(config) and SECRET.decode() not in repr(config)


def test_a_single_node_reads_no_secret(tiny_llama, counted, monkeypatch):
    monkeypatch.setenv("MLXCEL_CLUSTER_SECRET", "short")  # an error for any role that reads it
    config = config_of("-m", str(tiny_llama))
    assert config.role == "single" and config.secret is None and counted["load_secret"] == 0


def test_the_flags_are_frozen_and_typed_by_feature():
    flags = as_flags(build_parser().parse_args(["serve", "--tp-size", "2", "--node-role", "prefill",
                                                "--pp-spare", "1", "--api-key-file", "k"]))
    assert isinstance(flags, ServeFlags)
    assert (flags.tp.tp_size, flags.disagg.node_role, flags.bringup.pp_spare, flags.access.api_key_file) == (
        2, "prefill", 1, "k")
    with pytest.raises(AttributeError):
        flags.tp.tp_size = 3  # type: ignore[misc]
    parsed = vars(build_parser().parse_args(["serve"]))
    every = set(flags.values())
    assert every == set(parsed) - {"command", "func"}  # every serve flag has its typed field, and no more


def test_check_resolves_peers_without_changing_the_parsed_flags():
    flags = as_flags(build_parser().parse_args(["serve", "--pp-auto", "2", "--peers", "127.0.0.3:1,127.0.0.4:1"]))
    checked = flags.check()
    assert checked.bringup.cluster_peers == "127.0.0.3:1,127.0.0.4:1" and checked.cluster.peers is None
    assert flags.cluster.peers == "127.0.0.3:1,127.0.0.4:1" and flags.bringup.cluster_peers is None
    with pytest.raises(CLIError, match="--peers needs --pp-auto"):
        as_flags(build_parser().parse_args(["serve", "--peers", "127.0.0.3:1"])).check()


@pytest.mark.parametrize("argv, message", [
    (["--pp-layers", "0-1,2-3"], "--tp-size 2 cannot be combined with --pp-layers: tensor parallelism runs the whole "
                                 "model on every rank (pipeline stages are not sharded)"),
    (["--pp-size", "2"], "--tp-size 2 cannot be combined with --pp-size 2"),
])
def test_generate_refuses_tp_with_a_pipeline_before_the_model_is_read(tmp_path, capsys, argv, message):
    from mlxcel.cli import main

    code = main(["generate", "-m", str(tmp_path / "absent"), "-p", "x", "--tp-size", "2", *argv])
    assert code == 1 and capsys.readouterr().err.strip() == f"mlxcel: error: {message}"
