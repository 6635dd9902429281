"""The cluster TOML: every inconsistency is one line naming the file and the key; fail closed without a secret."""

from __future__ import annotations

import argparse
import os
import sys

import pytest

from mlxcel.cluster.secret import TOML_FIELD
from mlxcel.topology.cluster_config import ClusterConfigError, load_cluster_config
from mlxcel.commands.serve import cluster_node, process_secret
from mlxcel.pipeline.coordinator import fill_micro_batches
from tests.commands.test_cli import assert_one_line_error, mlxcel
from tests.pipeline.cluster_toml import COORDINATOR_AND_STAGE_0, write_toml

pytestmark = pytest.mark.proc  # starts processes (tests/proc_marker.py)

GOOD = """
[cluster]
name = "c1"
pipeline_parallel_size = 2
secret_file = "s.secret"
[pipeline]
max_batch_size = 4
[timeouts]
exchange_s = 5
""" + COORDINATOR_AND_STAGE_0 + """layers = "0-1"
[[nodes]]
id = "stage-1"
role = "stage"
address = "127.0.0.4:19002"
layers = "2-3"
"""


def test_loads_the_example_and_a_full_file(tmp_path):
    config = load_cluster_config(write_toml(tmp_path, GOOD))
    assert config.name == "c1" and config.pipeline_parallel_size == 2
    assert [n.layers for n in config.stages] == [(0, 2), (2, 4)]
    assert config.secret_file == tmp_path / "s.secret"
    assert config.timeouts.exchange_s == 5 and config.max_batch_size == 4
    assert config.micro_batch(4) == 2
    assert config.micro_batch_fill is None and fill_micro_batches(config)  # unset: by device (the CPU here)
    for value in (True, False):
        filled = load_cluster_config(write_toml(tmp_path, GOOD.replace("[pipeline]", f"[pipeline]\nmicro_batch_fill = {str(value).lower()}")))
        assert filled.micro_batch_fill is value and fill_micro_batches(filled) is value
    config.check_layers(4)
    example = load_cluster_config("examples/cluster-loopback.toml")
    example.check_layers(30)


@pytest.mark.parametrize("change, message", [
    (("pipeline_parallel_size = 2", "pipeline_parallel_size = 3"), "pipeline_parallel_size is 3 but 2 stage node(s)"),
    (('role = "coordinator"', 'role = "stage"'), "exactly one node with role"),
    (('address = "127.0.0.3:19001"', 'address = "127.0.0.2:19000"'), "is used by another node"),
    (('address = "127.0.0.3:19001"', 'address = "stage0.lan:19001"'), "numeric ip:port"),
    (('address = "127.0.0.3:19001"', 'address = "127.0.0.3:0"'), "needs a fixed port"),
    (('id = "stage-1"', 'id = "stage-0"'), "duplicate id"),
    (('role = "stage"\naddress = "127.0.0.4', 'role = "worker"\naddress = "127.0.0.4'), "role must be one of"),
    (('layers = "2-3"', 'layers = "3-2"'), "is reversed"),
    (('layers = "2-3"', 'layers = "two"'), "one inclusive range"),
    (('secret_file = "s.secret"', 'secret = "hunter2hunter2hunter2"'), "never goes into the TOML"),
    (("exchange_s = 5", "exchange_s = -1"), "positive number of seconds"),
    (("max_batch_size = 4", "max_batch_size = 0"), "positive integer"),
    (("max_batch_size = 4", "max_batch_size = 4\nmicro_batch_fill = 1"), "micro_batch_fill under [pipeline] must be true or false"),
    (('[timeouts]', '[timeouts]\nbogus = 1'), "unknown key(s) bogus in [timeouts]"),
])
def test_inconsistencies_are_named(tmp_path, change, message):
    text = GOOD.replace(*change)
    assert text != GOOD
    with pytest.raises(ClusterConfigError) as err:
        load_cluster_config(write_toml(tmp_path, text))
    assert message in str(err.value) and str(tmp_path / "cluster.toml") in str(err.value)
    assert "hunter2" not in str(err.value)


def test_ranges_must_cover_the_model(tmp_path):
    config = load_cluster_config(write_toml(tmp_path, GOOD.replace('layers = "2-3"', 'layers = "3-3"')))
    with pytest.raises(ClusterConfigError, match="must be contiguous"):
        config.check_layers(4)
    with pytest.raises(ClusterConfigError, match="must cover every layer"):
        load_cluster_config(write_toml(tmp_path, GOOD)).check_layers(6)


def test_not_toml_and_missing_file(tmp_path):
    with pytest.raises(ClusterConfigError, match="not valid TOML"):
        load_cluster_config(write_toml(tmp_path, "[cluster\n"))
    with pytest.raises(ClusterConfigError, match="cannot read"):
        load_cluster_config(tmp_path / "nope.toml")


def test_server_refuses_to_start_without_a_secret(tmp_path, tiny_llama):
    path = write_toml(tmp_path, GOOD.replace('secret_file = "s.secret"\n', ""))
    env_free = {"MLXCEL_CLUSTER_SECRET": None, "MLXCEL_CLUSTER_SECRET_FILE": None}
    import subprocess

    env = {k: v for k, v in os.environ.items() if k not in env_free}
    for node in ("stage-0", "coordinator"):
        result = subprocess.run([sys.executable, "-m", "mlxcel", "serve", "-m", str(tiny_llama), "--distributed-config",
                                 str(path), "--node-id", node, "--host", "127.0.0.3", "--port", "0"],
                                capture_output=True, text=True, timeout=60, env=env)
        assert_one_line_error(result, "a cluster secret is required")
        for source in ("--cluster-secret-file", "MLXCEL_CLUSTER_SECRET_FILE", "MLXCEL_CLUSTER_SECRET", "secret_file"):
            assert source in result.stderr


def test_server_names_an_unknown_node_and_bad_ranges(tmp_path, tiny_llama):
    (tmp_path / "s.secret").write_text("x" * 32)
    path = write_toml(tmp_path, GOOD)
    result = mlxcel("serve", "-m", str(tiny_llama), "--distributed-config", str(path), "--node-id", "stage-9", "--port", "0")
    assert_one_line_error(result, "no node with id 'stage-9'")
    bad = write_toml(tmp_path, GOOD.replace('layers = "2-3"', 'layers = "2-5"'))
    result = mlxcel("serve", "-m", str(tiny_llama), "--distributed-config", str(bad), "--node-id", "stage-0", "--port", "0")
    assert_one_line_error(result, "the model has only 4 layers")


_opened: list[str] | None = None  # while a test records: every path this process opens


def _record_opens(event: str, args: tuple) -> None:
    if event == "open" and _opened is not None and isinstance(args[0], (str, bytes, os.PathLike)):
        _opened.append(os.path.realpath(os.fsdecode(args[0])))


def test_a_node_reads_the_cluster_toml_once(tmp_path, tiny_llama, monkeypatch):
    """The config loader parses the TOML; the secret loader gets its secret_file, never the TOML again."""
    global _opened
    (tmp_path / "s.secret").write_text("t" * 32 + "\n")
    path = write_toml(tmp_path, GOOD)
    for name in ("MLXCEL_CLUSTER_SECRET", "MLXCEL_CLUSTER_SECRET_FILE"):
        monkeypatch.delenv(name, raising=False)
    args = argparse.Namespace(distributed_config=str(path), node_id="stage-0", cluster_secret_file=None)
    if not getattr(_record_opens, "added", False):
        sys.addaudithook(_record_opens)  # audit hooks cannot be removed: it records only while _opened is a list
        _record_opens.added = True  # type: ignore[attr-defined]
    _opened = []
    try:
        dist = cluster_node(args, tiny_llama)
        secret = process_secret(args, "stage", dist)
        opened = list(_opened)
    finally:
        _opened = None
    assert opened.count(os.path.realpath(path)) == 1
    assert opened.count(os.path.realpath(tmp_path / "s.secret")) == 1
    assert secret.reveal() == b"t" * 32 and secret.source == TOML_FIELD
    assert [n.layers for n in dist.cluster.stages] == [(0, 2), (2, 4)]
