"""Role flags, cluster TOML roles, the secret (fail closed), the allowlist's parsing, stats verbosity."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mlxcel import envs

from mlxcel.cli import build_parser
from mlxcel.cluster.errors import SecretError
from mlxcel.cluster.identity import PeerId
from mlxcel.disagg.allowlist import Allowlist
from mlxcel.commands.serve import as_flags, process_secret
from mlxcel.disagg.flags import node_config
from mlxcel.entrypoints.router import stats_verbose
from mlxcel.errors import CLIError
from mlxcel.topology.cluster_config import ClusterConfigError, load_cluster_config
from mlxcel.entrypoints import select_role

pytestmark = pytest.mark.proc  # starts processes (tests/proc_marker.py)

NO_SECRET_ENV = {k: v for k, v in os.environ.items() if not k.startswith("MLXCEL_CLUSTER_SECRET")}


def args(*argv: str):
    """The server's typed flags (``ServeFlags``) of a command line."""
    return as_flags(build_parser().parse_args(["serve", *argv]))


def check_disagg_flags(flags, dist):
    """The one check of the disaggregated flags (``mlxcel.commands.serve.serve_config`` runs it once)."""
    return flags.disagg.check(dist, pp_auto=flags.bringup.pp_auto, pp_peer=flags.bringup.pp_peer)


@pytest.mark.parametrize("argv, words", [
    (("--serving-bind", "127.0.0.1:9000"), "needs --node-role prefill, decode or router"),
    (("--node-role", "hybrid", "--decode-peers", "127.0.0.1:9000"), "needs --node-role"),
    (("--node-role", "decode"), "needs --serving-bind"),
    (("--node-role", "router", "--serving-bind", "127.0.0.1:9000", "--prefill-peers", "127.0.0.2:9001"),
     "needs --prefill-peers and --decode-peers"),
    (("--node-role", "decode", "--serving-bind", "127.0.0.1:9000", "--decode-peers", "127.0.0.2:9001"),
     "a decode node does not use it"),
    (("--node-role", "prefill", "--serving-bind", "127.0.0.1:9000", "--prefill-peers", "127.0.0.2:9001"),
     "is a router flag"),
    (("--node-role", "prefill", "--serving-bind", "host.lan:9000"), "not a numeric ip:port"),
    (("--node-role", "prefill", "--serving-bind", "127.0.0.1:0"), "needs a fixed port"),
    (("--node-role", "router", "--serving-bind", "127.0.0.1:9000", "--prefill-peers", "127.0.0.2:9001,127.0.0.2:9001",
      "--decode-peers", "127.0.0.3:9002"), "names an address twice"),
    (("--node-role", "router", "--serving-bind", "127.0.0.1:9000", "--prefill-peers", "0.0.0.0:9001",
      "--decode-peers", "127.0.0.3:9002"), "not an address a node can be reached at"),
    (("--node-role", "prefill", "--serving-bind", "127.0.0.1:9000", "--probe-interval", "1"), "is a router flag"),
    (("--node-role", "prefill", "--serving-bind", "127.0.0.1:9000", "--pp-peer"), "cannot be combined"),
    (("--node-role", "prefill", "--serving-bind", "127.0.0.1:9000", "--route-policy", "prefix"),
     "--route-policy is a router flag"),
    (("--node-role", "decode", "--serving-bind", "127.0.0.1:9000", "--route-index-blocks", "8"),
     "--route-index-blocks is a router flag"),
    (("--route-policy", "round-robin",), "needs --node-role prefill, decode or router"),
])
def test_bad_flag_combinations_are_named(argv, words):
    with pytest.raises(CLIError, match=re.escape(words)):
        check_disagg_flags(args(*argv), None)


ROUTER = ("--node-role", "router", "--serving-bind", "127.0.0.1:9000", "--prefill-peers", "127.0.0.2:1",
          "--decode-peers", "127.0.0.3:2")


@pytest.mark.parametrize("extra, policy, blocks", [
    ((), "prefix", 32768), (("--route-policy", "round-robin"), "round-robin", 32768),
    (("--route-policy", "prefix", "--route-index-blocks", "500"), "prefix", 500),
])
def test_the_route_policy_and_index_bound_reach_the_router_config(extra, policy, blocks):
    flags = args(*ROUTER, *extra)
    check_disagg_flags(flags, None)
    cfg = node_config(flags.disagg, None)
    assert (cfg.route_policy, cfg.route_index_blocks) == (policy, blocks)


@pytest.mark.parametrize("argv", [("--route-policy", "random"), ("--route-index-blocks", "0"),
                                  ("--route-index-blocks", "many")])
def test_a_bad_route_flag_is_refused_by_the_parser(argv, capsys):
    with pytest.raises(SystemExit):
        args(*ROUTER, *argv)
    assert argv[0] in capsys.readouterr().err


def test_roles_select_their_modules():
    router = args("--node-role", "router", "--serving-bind", "127.0.0.1:9000", "--prefill-peers", "127.0.0.2:1",
                  "--decode-peers", "127.0.0.3:2")
    assert select_role(router, None).module == "mlxcel.entrypoints.router"
    assert select_role(args("--node-role", "prefill"), None).serves_api is False
    assert select_role(args("--node-role", "decode"), None).module == "mlxcel.entrypoints.decode"
    assert select_role(args("--node-role", "hybrid"), None).name == "single"
    assert select_role(args(), None).name == "single"


def test_every_role_needs_the_secret_naming_every_source(monkeypatch):
    monkeypatch.delenv("MLXCEL_CLUSTER_SECRET", raising=False)
    monkeypatch.delenv("MLXCEL_CLUSTER_SECRET_FILE", raising=False)
    for role in ("prefill", "decode", "router"):
        a = args("--node-role", role, "--serving-bind", "127.0.0.1:9000",
                 *(("--prefill-peers", "127.0.0.2:1", "--decode-peers", "127.0.0.3:2") if role == "router" else ()))
        with pytest.raises(SecretError) as info:
            process_secret(a, role, None)
        for source in ("--cluster-secret-file", "MLXCEL_CLUSTER_SECRET_FILE", "MLXCEL_CLUSTER_SECRET", "secret_file"):
            assert source in str(info.value)


def test_the_switch_interval_is_half_a_millisecond_unless_the_environment_says(monkeypatch, tmp_path):
    secret = tmp_path / "s.secret"
    secret.write_text("x" * 32 + "\n")
    secret.chmod(0o600)
    a = args("--node-role", "decode", "--serving-bind", "127.0.0.1:9000", "--cluster-secret-file", str(secret))
    monkeypatch.delenv("MLXCEL_SWITCH_INTERVAL_MS", raising=False)
    assert node_config(a.disagg, None).switch_interval_s == 0.0005
    monkeypatch.setenv("MLXCEL_SWITCH_INTERVAL_MS", "2")
    assert node_config(a.disagg, None).switch_interval_s == 0.002
    for bad, words in (("fast", "a number of milliseconds"), ("0", "from 0.01 to 100"), ("500", "from 0.01 to 100")):
        monkeypatch.setenv("MLXCEL_SWITCH_INTERVAL_MS", bad)
        with pytest.raises(CLIError, match=f"MLXCEL_SWITCH_INTERVAL_MS must be .*{words}"):
            node_config(a.disagg, None)
    router = args("--node-role", "router", "--serving-bind", "127.0.0.1:9000", "--prefill-peers", "127.0.0.2:1",
                  "--decode-peers", "127.0.0.3:2", "--cluster-secret-file", str(secret))
    with pytest.raises(CLIError, match="MLXCEL_SWITCH_INTERVAL_MS must be"):  # every role refuses a bad variable
        node_config(router.disagg, None)
    monkeypatch.delenv("MLXCEL_SWITCH_INTERVAL_MS")
    assert node_config(router.disagg, None).role == "router"


def test_the_handoff_environment_is_read_into_the_config_and_a_bad_value_is_named(monkeypatch, tmp_path):
    secret = tmp_path / "s.secret"
    secret.write_text("x" * 32 + "\n")
    secret.chmod(0o600)
    common = ("--serving-bind", "127.0.0.1:9000", "--cluster-secret-file", str(secret))
    prefill, decode = args("--node-role", "prefill", *common), args("--node-role", "decode", *common)
    monkeypatch.setenv("MLXCEL_HANDOFF_LANES", "3")
    monkeypatch.setenv("MLXCEL_HANDOFF_INTAKE_WORKERS", "2")
    monkeypatch.setenv("MLXCEL_HANDOFF_COPY", "1")
    assert node_config(prefill.disagg, None).handoff_lanes == 3
    assert node_config(prefill.disagg, None).handoff_staging is None  # unset: staged where MLX runs on CUDA
    monkeypatch.setenv("MLXCEL_HANDOFF_STAGING", "0")
    assert node_config(decode.disagg, None).handoff_staging is False
    cfg = node_config(decode.disagg, None)
    assert (cfg.intake_workers, cfg.handoff_copy) == (2, True)
    for name, bad, words, a in (("MLXCEL_HANDOFF_LANES", "many", "a whole number", prefill),
                                ("MLXCEL_HANDOFF_LANES", "17", "from 1 to 16", prefill),
                                ("MLXCEL_HANDOFF_INTAKE_WORKERS", "-1", "from 0 to 64", decode),
                                ("MLXCEL_HANDOFF_INTAKE_WORKERS", "2.5", "a whole number", decode),
                                ("MLXCEL_HANDOFF_COPY", "maybe", "1 or 0", decode),
                                ("MLXCEL_HANDOFF_STAGING", "auto", "1 or 0", prefill)):
        with monkeypatch.context() as env:
            env.setenv(name, bad)
            envs.reload()  # a fresh process would read the changed environment
            with pytest.raises(CLIError, match=f"{name} must be .*{words}"):
                node_config(a.disagg, None)
        envs.reload()


def test_a_bad_handoff_variable_stops_a_decode_node_before_its_model_loads(tmp_path, tiny_llama):
    secret = tmp_path / "s.secret"
    secret.write_text("x" * 32 + "\n")
    secret.chmod(0o600)
    cmd = [sys.executable, "-m", "mlxcel", "serve", "-m", str(tiny_llama), "--node-role", "decode",
           "--serving-bind", "127.0.0.43:19998", "--cluster-secret-file", str(secret), "--port", "0"]
    for name in ("MLXCEL_HANDOFF_INTAKE_WORKERS", "MLXCEL_CRYPTO_WORKERS"):
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env={**NO_SECRET_ENV, name: "lots"})
        assert done.returncode != 0
        assert f"{name} must be a whole number, not 'lots'" in done.stderr
        assert "loading" not in done.stderr.lower() and "Traceback" not in done.stderr


def test_the_cli_refuses_to_start_a_router_without_the_secret(tiny_llama):
    cmd = [sys.executable, "-m", "mlxcel", "serve", "-m", str(tiny_llama), "--node-role", "router",
           "--serving-bind", "127.0.0.40:19999", "--prefill-peers", "127.0.0.41:1", "--decode-peers", "127.0.0.42:2",
           "--port", "0"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=NO_SECRET_ENV)
    assert done.returncode != 0
    assert "a cluster secret is required" in done.stderr and "--cluster-secret-file" in done.stderr
    assert "serving" not in done.stderr  # refused before anything listened
    hybrid = subprocess.run([*cmd[:6], "--node-role", "hybrid", "--serving-bind", "127.0.0.40:1"],
                            capture_output=True, text=True, timeout=60, env=NO_SECRET_ENV)
    assert hybrid.returncode != 0 and "needs --node-role prefill, decode or router" in hybrid.stderr


DISAGG_TOML = """
[cluster]
name = "di"
secret_file = "s.secret"

[timeouts]
heartbeat_s = 0.5

[[nodes]]
id = "router"
role = "router"
address = "127.0.0.50:19000"

[[nodes]]
id = "p0"
role = "prefill"
address = "127.0.0.51:19001"

[[nodes]]
id = "d0"
role = "decode"
address = "127.0.0.52:19002"

[[nodes]]
id = "d1"
role = "decode"
address = "127.0.0.53:19003"
"""


def write_toml(tmp: Path, text: str = DISAGG_TOML) -> Path:
    (tmp / "s.secret").write_text("x" * 32 + "\n")
    (tmp / "s.secret").chmod(0o600)
    path = tmp / "cluster.toml"
    path.write_text(text)
    return path


def test_the_cluster_toml_gives_the_roles_their_addresses_and_peers(tmp_path, tiny_llama):
    from mlxcel.commands.serve import cluster_node

    toml = write_toml(tmp_path)
    cluster = load_cluster_config(toml)
    assert cluster.coordinator is None and cluster.stages == ()
    assert [n.id for n in cluster.with_role("decode")] == ["d0", "d1"]
    for node_id, role in (("router", "router"), ("p0", "prefill"), ("d1", "decode")):
        a = args("-m", str(tiny_llama), "--distributed-config", str(toml), "--node-id", node_id)
        dist = cluster_node(a, tiny_llama)
        assert select_role(a, dist).name == role
        cfg = node_config(a.disagg, dist)
        assert cfg.role == role and cfg.serving_bind == dist.node.address and cfg.probe_interval_s == 0.5
        secret = process_secret(a, role, dist)
        assert secret.source == "secret_file under [cluster]" or secret.path == (tmp_path / "s.secret").resolve()
    router = node_config(args("--distributed-config", str(toml), "--node-id", "router").disagg,
                         cluster_node(args("--distributed-config", str(toml), "--node-id", "router"), tiny_llama))
    assert router.prefill_peers == (PeerId.parse("127.0.0.51:19001"),)
    assert router.decode_peers == (PeerId.parse("127.0.0.52:19002"), PeerId.parse("127.0.0.53:19003"))
    a = args("--distributed-config", str(toml), "--node-id", "p0", "--node-role", "decode")
    with pytest.raises(CLIError, match="contradicts node 'p0'"):
        check_disagg_flags(a, cluster_node(a, tiny_llama))
    a = args("--distributed-config", str(toml), "--node-id", "p0", "--serving-bind", "127.0.0.51:1")
    with pytest.raises(CLIError, match="come from the cluster TOML"):
        check_disagg_flags(a, cluster_node(a, tiny_llama))


@pytest.mark.parametrize("change, words", [
    (("role = \"router\"", "role = \"stage\""), "pipeline or disaggregated, not both"),
    (("id = \"p0\"\nrole = \"prefill\"", "id = \"p0\"\nrole = \"decode\""), "at least one node with role = \"prefill\""),
    (("name = \"di\"", "name = \"di\"\npipeline_parallel_size = 2"),
     "pipeline_parallel_size under [cluster] is for pipelines"),
    (("address = \"127.0.0.52:19002\"", "address = \"0.0.0.0:19002\""), "a decode node's address must be the IP"),
])
def test_inconsistent_disaggregated_tomls_are_named(tmp_path, change, words):
    with pytest.raises(ClusterConfigError, match=re.escape(words)):
        load_cluster_config(write_toml(tmp_path, DISAGG_TOML.replace(*change)))


def test_the_allowlist_parses_numeric_entries_and_skips_the_rest(caplog):
    allow = Allowlist.parse(" 127.0.0.1:9000, host.lan:9001,[::1]:9002,127.0.0.2 ,")
    assert allow.entries == {PeerId.parse("127.0.0.1:9000"), PeerId.parse("[::1]:9002")}
    assert allow.skipped == ("host.lan:9001", "127.0.0.2")
    assert allow.allows(PeerId.parse("127.0.0.1:9000")) and not allow.allows(PeerId.parse("127.0.0.1:9001"))
    with caplog.at_level("WARNING"):
        permissive = Allowlist.from_env({"MLXCEL_DECODE_ALLOWLIST": "decode.lan:1"})
    assert permissive.entries is None and permissive.allows(PeerId.parse("10.0.0.9:1"))
    assert "skipping 'decode.lan:1'" in caplog.text and "has no valid entry" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        assert Allowlist.from_env({}).entries is None
    assert "MLXCEL_DECODE_ALLOWLIST is not set" in caplog.text


@pytest.mark.parametrize("value, verbose", [("1", True), ("true", True), ("YES", True), (" On ", True), ("0", False),
                                             ("", False), ("verbose", False)])
def test_stats_verbosity_follows_the_variable(value, verbose):
    assert stats_verbose({"MLXCEL_ROUTER_STATS_VERBOSE": value}) is verbose
    assert stats_verbose({}) is False


def test_the_example_toml_loads_as_a_disaggregated_cluster():
    from mlxcel.topology.cluster_config import load_cluster_config

    example = Path(__file__).resolve().parents[2] / "examples" / "disagg-loopback.toml"
    cluster = load_cluster_config(example)
    assert [n.id for n in cluster.with_role("router")] == ["router"]
    assert [str(n.address) for n in cluster.with_role("decode")] == ["127.0.0.13:19103", "127.0.0.14:19104"]
    text = example.read_text()
    for node in cluster.nodes:
        assert f"--node-id {node.id} " in text  # every node has its start line
