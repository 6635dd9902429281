"""Rows of the reference (``mlxcel-distributed.md``) the audit of issue 40 found untrue, each held true here:
the server's ``--pp-layers`` and ``--peers``, the secret's fail-closed scope (one-stage clusters, in-process
tensor parallelism), native Windows refusals, ``--cluster-discovery-port`` and ``--pp-micro-batch-size`` bounds."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxcel.cli import build_parser, main
from mlxcel.commands.serve import check_flags, cluster_node, process_secret
from tests.pipeline.cluster_toml import COORDINATOR_AND_STAGE_0, write_toml

STAGE_1 = """[[nodes]]
id = "stage-1"
role = "stage"
address = "127.0.0.4:19002"
"""


@pytest.fixture(autouse=True)
def no_secret_in_environment(monkeypatch):
    monkeypatch.delenv("MLXCEL_CLUSTER_SECRET", raising=False)
    monkeypatch.delenv("MLXCEL_CLUSTER_SECRET_FILE", raising=False)


def parsed(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def error_of(capsys, *argv: str) -> str:
    """``mlxcel ARGV`` fails with one line on stderr and exit 1; the message."""
    code = main(list(argv))
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("mlxcel: error: ") and err.count("\n") == 1, (code, err)
    return err[len("mlxcel: error: "):].strip()


def usage_error(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(list(argv))
    assert exc.value.code == 2
    return capsys.readouterr().err


def secret_file(tmp_path: Path) -> Path:
    path = tmp_path / "cluster.secret"
    path.write_text("s" * 32)
    path.chmod(0o600)
    return path


def two_stage_toml(tmp_path: Path, layers: tuple[str, str] | None = None, size: int = 2) -> Path:
    text = COORDINATOR_AND_STAGE_0 + (f'layers = "{layers[0]}"\n' if layers else "") + STAGE_1
    text += f'layers = "{layers[1]}"\n' if layers else ""
    return write_toml(tmp_path, f"[cluster]\npipeline_parallel_size = {size}\n" + text)


# -- 1. the server's --pp-layers and --peers ------------------------------------------------------------------


def test_server_pp_layers_sets_the_stage_ranges_of_a_toml_without_layers(tmp_path, tiny_llama):
    toml = two_stage_toml(tmp_path)
    args = parsed("-m", str(tiny_llama), "--distributed-config", str(toml), "--node-id", "stage-1",
                  "--pp-layers", "0-0,1-3", "--cluster-secret-file", str(secret_file(tmp_path)))
    check_flags(args)
    dist = cluster_node(args, tiny_llama)
    assert [s.layers for s in dist.cluster.stages] == [(0, 1), (1, 4)]
    assert dist.node.layers == (1, 4)


def test_server_pp_layers_equal_to_the_toml_layers_is_accepted(tmp_path, tiny_llama):
    toml = two_stage_toml(tmp_path, ("0-1", "2-3"))
    args = parsed("-m", str(tiny_llama), "--distributed-config", str(toml), "--node-id", "coordinator",
                  "--pp-layers", "0-1,2-3", "--cluster-secret-file", str(secret_file(tmp_path)))
    assert [s.layers for s in cluster_node(args, tiny_llama).cluster.stages] == [(0, 2), (2, 4)]


@pytest.mark.parametrize("layers,toml_layers,message", [
    ("0-1,2-2", None, "--pp-layers: the last stage ends at 2 but the model has 4 layers"),
    ("0-1,2-4", None, "--pp-layers: stage 1 ends at 4 but the model has only 4 layers"),
    ("0-3", None, "--pp-layers names 1 stage but {toml} has 2 (pipeline_parallel_size 2)"),
    ("0-0,1-3", ("0-1", "2-3"), "--pp-layers 0-0,1-3 contradicts the stage layers of {toml} (0-1,2-3): give the "
                                "same ranges, or leave layers out of the TOML"),
])
def test_server_pp_layers_refusals_name_the_flag(tmp_path, capsys, tiny_llama, layers, toml_layers, message):
    toml = two_stage_toml(tmp_path, toml_layers)
    got = error_of(capsys, "serve", "-m", str(tiny_llama), "--port", "0", "--distributed-config", str(toml),
                   "--node-id", "coordinator", "--pp-layers", layers,
                   "--cluster-secret-file", str(secret_file(tmp_path)))
    assert got.startswith(message.format(toml=toml)), got


@pytest.mark.parametrize("argv,message", [
    (["--pp-layers", "0-1,2-3"], "--pp-layers needs --distributed-config (it sets the stage layer ranges of its "
                                 "pipeline)"),
    (["--pp-layers", "0-1,3-3"], "--pp-layers: stage 1 starts at 3 but stage 0 ended at 1 (ranges must be contiguous)"),
    (["--pp-layers", "0-x"], "--pp-layers: stage 0: '0-x' is not a layer range"),
    (["--pp-auto", "2", "--cluster-peers", "127.0.0.3:1,127.0.0.4:1", "--pp-layers", "0-1,2-3"],
     "--pp-layers cannot be combined with --pp-auto: each --pp-peer derives its stage's layers from its own "
     "checkpoint and refuses any other range"),
    (["--pp-peer", "--cluster-control-addr", "127.0.0.3:1", "--pp-layers", "0-1,2-3"],
     "--pp-layers cannot be combined with --pp-peer: the coordinator assigns a peer its layers"),
])
def test_server_pp_layers_flag_combinations(tmp_path, capsys, argv, message):
    assert error_of(capsys, "serve", "-m", str(tmp_path / "absent"), "--port", "0", *argv).startswith(message)


def test_server_pp_layers_with_a_disaggregated_toml_is_refused(tmp_path, capsys, tiny_llama):
    toml = write_toml(tmp_path, "\n".join(
        f'[[nodes]]\nid = "{role}-0"\nrole = "{role}"\naddress = "127.0.0.{i}:1900{i}"'
        for i, role in enumerate(("router", "prefill", "decode"), start=2)) + "\n")
    got = error_of(capsys, "serve", "-m", str(tiny_llama), "--port", "0", "--distributed-config", str(toml),
                   "--node-id", "prefill-0", "--pp-layers", "0-3", "--cluster-secret-file", str(secret_file(tmp_path)))
    assert got == (f"--pp-layers sets the stage layers of a pipeline; {toml} is a disaggregated cluster (every "
                   "node holds the whole model)")


def test_peers_is_the_cluster_peers_of_a_pp_auto_coordinator():
    args = parsed("--pp-auto", "2", "--peers", "127.0.0.3:1,127.0.0.4:1")
    assert check_flags(args).bringup.cluster_peers == "127.0.0.3:1,127.0.0.4:1"


def test_peers_is_the_decode_peers_of_a_prefill_node():
    args = parsed("--node-role", "prefill", "--serving-bind", "127.0.0.3:1", "--peers", "127.0.0.4:1")
    assert check_flags(args).disagg.decode_peers == "127.0.0.4:1"


@pytest.mark.parametrize("argv,message", [
    (["--peers", "127.0.0.3:1"], "--peers needs --pp-auto (its --cluster-peers) or --node-role prefill (its "
                                 "--decode-peers)"),
    (["--node-role", "router", "--serving-bind", "127.0.0.3:1", "--peers", "127.0.0.4:1"],
     "--peers is ambiguous for --node-role router: give --prefill-peers and --decode-peers"),
    (["--node-role", "decode", "--serving-bind", "127.0.0.3:1", "--peers", "127.0.0.4:1"],
     "--peers needs --pp-auto (its --cluster-peers) or --node-role prefill (its --decode-peers)"),
    (["--pp-auto", "1", "--peers", "127.0.0.3:1", "--cluster-peers", "127.0.0.3:1"],
     "--peers and --cluster-peers name the same list; give one of them"),
    (["--node-role", "prefill", "--serving-bind", "127.0.0.3:1", "--peers", "127.0.0.4:1", "--decode-peers",
      "127.0.0.4:1"], "--peers and --decode-peers name the same list; give one of them"),
])
def test_peers_refusals(tmp_path, capsys, argv, message):
    assert error_of(capsys, "serve", "-m", str(tmp_path / "absent"), "--port", "0", *argv).startswith(message)


# -- 3. the secret's fail-closed scope: from two stages ------------------------------------------------------


def test_a_one_stage_cluster_starts_without_a_secret(tmp_path, tiny_llama):
    toml = write_toml(tmp_path, "[cluster]\npipeline_parallel_size = 1\n" + COORDINATOR_AND_STAGE_0)
    args = parsed("-m", str(tiny_llama), "--distributed-config", str(toml), "--node-id", "coordinator")
    dist = cluster_node(args, tiny_llama)
    assert process_secret(args, "coordinator", dist) is None and dist.node.id == "coordinator"


def test_a_one_stage_cluster_still_reads_a_configured_secret(tmp_path, tiny_llama, monkeypatch):
    toml = write_toml(tmp_path, "[cluster]\npipeline_parallel_size = 1\n" + COORDINATOR_AND_STAGE_0)
    args = parsed("-m", str(tiny_llama), "--distributed-config", str(toml), "--node-id", "stage-0",
                  "--cluster-secret-file", str(secret_file(tmp_path)))
    assert process_secret(args, "stage", cluster_node(args, tiny_llama)) is not None
    monkeypatch.setenv("MLXCEL_CLUSTER_SECRET", "short")  # a bad configured secret is still refused
    args = parsed("-m", str(tiny_llama), "--distributed-config", str(toml), "--node-id", "stage-0")
    with pytest.raises(Exception, match="too short"):
        process_secret(args, "stage", cluster_node(args, tiny_llama))


def test_a_two_stage_cluster_refuses_to_start_without_a_secret(tmp_path, capsys, tiny_llama):
    toml = two_stage_toml(tmp_path)
    got = error_of(capsys, "serve", "-m", str(tiny_llama), "--port", "0", "--distributed-config", str(toml),
                   "--node-id", "coordinator")
    assert got.startswith("a cluster secret is required but none was configured: pass --cluster-secret-file")


# -- 5. --cluster-discovery-port is a UDP port, 1-65535 --------------------------------------------------------


@pytest.mark.parametrize("value", ["0", "65536", "-1"])
def test_discovery_port_is_bounded(capsys, value):
    err = usage_error(capsys, "serve", "--pp-peer", "--cluster-discovery", "mdns", "--cluster-discovery-port", value)
    assert "argument --cluster-discovery-port: must be a UDP port (1-65535), got" in err


def test_discovery_port_help_says_udp(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--cluster-discovery-port PORT mdns: the beacons' UDP port (1-65535; default 49555)" in help_text


# -- 6. --pp-micro-batch-size: one bound for both binaries and the TOML ----------------------------------------


@pytest.mark.parametrize("value,message", [("65", "--pp-micro-batch-size must be at most 64, got 65"),
                                           ("0", "--pp-micro-batch-size must be greater than 0")])
def test_micro_batch_size_has_one_bound(tmp_path, capsys, tiny_llama, value, message):
    toml = two_stage_toml(tmp_path)
    assert error_of(capsys, "serve", "-m", str(tiny_llama), "--port", "0", "--distributed-config", str(toml),
                    "--node-id", "coordinator", "--pp-micro-batch-size", value) == message
    assert error_of(capsys, "generate", "-m", str(tiny_llama), "-p", "x", "--pp-size", "2",
                    "--pp-micro-batch-size", value) == message


def test_toml_micro_batch_size_has_the_same_bound(tmp_path):
    from mlxcel.topology.cluster_config import ClusterConfigError, load_cluster_config

    toml = write_toml(tmp_path, "[pipeline]\nmicro_batch_size = 65\n" + COORDINATOR_AND_STAGE_0)
    with pytest.raises(ClusterConfigError, match=r"micro_batch_size under \[pipeline\] must be an integer from 1 to 64, got 65"):
        load_cluster_config(toml)
    toml.write_text("[pipeline]\nmicro_batch_size = 64\n" + COORDINATOR_AND_STAGE_0)
    assert load_cluster_config(toml).micro_batch_size == 64


# -- 2. tensor parallelism inside one process reads no secret ---------------------------------------------------


def test_in_process_tp_server_reads_no_secret(tmp_path, tiny_llama, monkeypatch):
    """Both environment variables set (an error for any role that reads them) and a short value: not read."""
    from mlxcel.commands.serve import serve_config

    monkeypatch.setenv("MLXCEL_CLUSTER_SECRET", "short")
    monkeypatch.setenv("MLXCEL_CLUSTER_SECRET_FILE", str(tmp_path / "absent"))
    config = serve_config(parsed("-m", str(tiny_llama), "--tp-size", "2",
                                 "--cluster-secret-file", str(tmp_path / "absent")))
    assert config.role == "tp" and config.secret is None


def test_tp_across_hosts_still_needs_the_secret(tmp_path, capsys, tiny_llama, monkeypatch):
    import json

    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([{"ssh": "a", "ips": ["127.0.0.1"]}, {"ssh": "b", "ips": ["127.0.0.1"]}]))
    monkeypatch.setenv("MLXCEL_CLUSTER_SECRET", "short")
    got = error_of(capsys, "serve", "-m", str(tiny_llama), "--port", "0", "--tp-size", "2",
                   "--tp-hostfile", str(hostfile))
    assert got.startswith("the cluster secret from MLXCEL_CLUSTER_SECRET is too short")


@pytest.mark.proc
@pytest.mark.timeout(120)
def test_in_process_tp_generate_reads_no_secret(tiny_llama):
    import os
    import subprocess
    import sys

    env = {**os.environ, "MLXCEL_CLUSTER_SECRET": "short"}
    out = subprocess.run([sys.executable, "-m", "mlxcel", "generate", "-m", str(tiny_llama), "-p", "hi", "-n", "2",
                          "--tp-size", "2"], capture_output=True, text=True, timeout=110, env=env)
    assert out.returncode == 0, out.stderr
    assert "over 2 ranks" in out.stderr



# -- 8. docs/pipeline.md §1.1 lists what actually slices -------------------------------------------------------


def test_pipeline_doc_lists_every_family_that_slices():
    import re

    from mlxcel.engine.model_slice import FAMILIES

    doc = (Path(__file__).resolve().parents[2] / "docs" / "pipeline.md").read_text()
    section = doc[doc.index("### 1.1 When to use it"):doc.index("### 1.2")]
    listed = section[section.index("Families that slice"):section.index("any other family is refused")]
    names = set(re.findall(r"`([a-z0-9_]+)`", listed.split("):", 1)[1].split("\n(", 1)[0]))
    assert names == set(FAMILIES)
