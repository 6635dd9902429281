"""The bring-up flags: exclusions, defaults and errors, each one line before anything is bound."""

from __future__ import annotations

import socket

import pytest

from mlxcel.bringup import flags as bringup_flags
from mlxcel.bringup.wire import DEFAULT_CONTROL_PORT, DEFAULT_DISCOVERY_PORT, DEFAULT_DISCOVERY_TARGET
from mlxcel.cli import build_parser, main
from mlxcel.cluster.identity import PeerId


def parsed(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def bringup_settings(args):
    """The resolved bring-up settings of a parsed command line (its typed flags and --host)."""
    from mlxcel.commands.serve import as_flags

    flags = as_flags(args)
    return bringup_flags.bringup_settings(flags.bringup, flags.server.host)


def error_of(capsys, *argv: str) -> str:
    code = main(["serve", "--port", "0", *argv])
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("mlxcel: error: ") and err.count("\n") == 1, err
    return err[len("mlxcel: error: "):].strip()


@pytest.mark.parametrize("argv,message", [
    (["--pp-auto", "2", "--pp-peer"], "--pp-auto and --pp-peer are mutually exclusive"),
    (["--pp-auto", "2", "--distributed-config", "c.toml", "--node-id", "coordinator"],
     "--pp-auto and --distributed-config are mutually exclusive"),
    (["--pp-auto", "2", "--distributed-config", "c.toml"], "--pp-auto and --distributed-config are mutually exclusive"),
    (["--dry-run"], "--dry-run needs --pp-auto"),
    (["--cluster-peers", "127.0.0.3:1"], "--cluster-peers needs --pp-auto or --pp-peer"),
    (["--cluster-name", "x"], "--cluster-name needs --pp-auto or --pp-peer"),
    (["--pp-auto", "2"], "--pp-auto 2 with static discovery needs --cluster-peers"),
    (["--pp-auto", "2", "--cluster-peers", "127.0.0.3:1"], "--cluster-peers lists 1 peer but --pp-auto is 2"),
    (["--pp-auto", "2", "--cluster-peers", "127.0.0.3:1,127.0.0.3:1"], "--cluster-peers lists an address twice"),
    (["--pp-auto", "1", "--cluster-peers", "host-b:19001"], "--cluster-peers: 'host-b:19001' is not a numeric ip:port"),
    (["--pp-auto", "1", "--cluster-peers", "127.0.0.3:0"], "127.0.0.3:0 is not an address a peer listens on"),
    (["--pp-auto", "1", "--cluster-peers", "127.0.0.1:19000"], "127.0.0.1:19000 is the coordinator's own control address"),
    (["--pp-auto", "1", "--cluster-peers", "192.0.2.7:19001"],
     "the coordinator's control address 127.0.0.1:19000 is on loopback, so the peer(s) 192.0.2.7:19001 on another "
     "host could not reach it"),
    (["--pp-auto", "1", "--host", "localhost", "--cluster-peers", "127.0.0.3:1"],
     "--host 'localhost' is not a numeric IP: pass --cluster-control-addr"),
    (["--pp-auto", "1", "--cluster-discovery", "mdns", "--cluster-peers", "127.0.0.3:1"],
     "--cluster-peers is for static discovery"),
    (["--pp-auto", "1", "--cluster-discovery", "mdns", "--cluster-discovery-target", "127.0.0.1"],
     "--cluster-discovery-target is where a --pp-peer sends its beacons"),
    (["--pp-auto", "1", "--cluster-peers", "127.0.0.3:1", "--cluster-discovery-port", "5"],
     "--cluster-discovery-port needs --cluster-discovery=mdns"),
    (["--pp-auto", "1", "--cluster-peers", "127.0.0.3:1", "--cluster-name", "a b"], "--cluster-name 'a b': 1 to 64"),
    (["--pp-peer"], "a --pp-peer with static discovery needs --cluster-control-addr IP:PORT"),
    (["--pp-peer", "--cluster-control-addr", "127.0.0.3:0"], "needs --cluster-control-addr IP:PORT"),
    (["--pp-peer", "--cluster-peers", "127.0.0.3:1"], "--cluster-peers is for the --pp-auto coordinator"),
    (["--pp-peer", "--cluster-discovery", "mdns", "--cluster-discovery-target", "broadcast"],
     "--cluster-discovery-target: 'broadcast' is not a numeric IP address"),
    (["--pp-peer", "--cluster-control-addr", "127.0.0.3:1", "--pp-micro-batch-size", "2"],
     "--pp-micro-batch-size needs --distributed-config or --pp-auto"),
    (["--pp-peer", "--cluster-control-addr", "127.0.0.3:1", "--pp-spare", "1"],
     "--pp-spare needs --pp-auto (the coordinator keeps the spare peers and assigns them)"),
    (["--pp-spare-after", "3"], "--pp-spare-after needs --pp-auto"),
    (["--pp-auto", "1", "--cluster-peers", "127.0.0.3:1", "--pp-spare-after", "3"],
     "--pp-spare-after needs --pp-spare 1 or more (with no spare peer there is nothing to assign)"),
    (["--pp-auto", "2", "--pp-spare", "1", "--cluster-peers", "127.0.0.3:1,127.0.0.4:1"],
     "--cluster-peers lists 2 peers but --pp-auto 2 with --pp-spare 1 needs 3 (2 stages and 1 spare)"),
    (["--pp-auto", "1", "--cluster-peers", "127.0.0.3:1,127.0.0.4:1", "--pp-spare", "1", "--pp-spare-after", "30"],
     "--pp-spare-after 30 is not below the resume timeout (30s, --resume-timeout): requests in flight would fail "
     "before a spare takes their stage over; lower --pp-spare-after or raise --resume-timeout"),
    (["--pp-auto", "1", "--cluster-peers", "127.0.0.3:1,127.0.0.4:1", "--pp-spare", "1", "--resume-timeout", "4"],
     "--pp-spare-after 5 is not below the resume timeout (4s, --resume-timeout)"),
    (["--pp-auto", "2", "--pp-spare", "2"], "--pp-auto 2 with --pp-spare 2 with static discovery needs --cluster-peers "
     "A:P,... (4 peer addresses)"),
])
def test_flag_errors_are_one_line(tmp_path, capsys, argv, message):
    assert message in error_of(capsys, "-m", str(tmp_path / "absent"), *argv)


@pytest.mark.parametrize("argv,message", [
    (["--pp-spare", "17"], "argument --pp-spare: must be at most 16 spare peers, got 17"),
    (["--pp-spare", "-1"], "argument --pp-spare:"),
    (["--pp-spare-after", "0"], "argument --pp-spare-after: must be > 0 seconds, got 0"),
    (["--pp-spare-after", "3601"], "argument --pp-spare-after: must be at most 3600 seconds, got 3601"),
])
def test_spare_flags_are_bounded(capsys, argv, message):
    with pytest.raises(SystemExit):
        parsed("--pp-auto", "1", *argv)
    assert message in capsys.readouterr().err


def test_spare_flags_defaults_and_values():
    settings = bringup_settings(parsed("--pp-auto", "2", "--cluster-peers", "127.0.0.3:1,127.0.0.4:1"))
    assert (settings.spares, settings.spare_after_s, settings.peer_count) == (0, 5.0, 2)
    settings = bringup_settings(parsed("--pp-auto", "2", "--pp-spare", "1", "--pp-spare-after", "1.5",
                                       "--cluster-peers", "127.0.0.3:1,127.0.0.4:1,127.0.0.5:1"))
    assert (settings.spares, settings.spare_after_s, settings.peer_count) == (1, 1.5, 3)


def test_pp_peer_with_dry_run_is_refused_before_any_socket_is_bound(tmp_path, capsys, tiny_llama):
    """Both of its ports are taken: binding either would be a different error."""
    with socket.socket() as http, socket.socket() as control:
        http.bind(("127.0.0.3", 0))
        http.listen()
        control.bind(("127.0.0.3", 0))
        control.listen()
        message = error_of(capsys, "-m", str(tiny_llama), "--pp-peer", "--dry-run", "--host", "127.0.0.3",
                           "--port", str(http.getsockname()[1]),
                           "--cluster-control-addr", f"127.0.0.3:{control.getsockname()[1]}")
    assert message == ("--dry-run is for the --pp-auto coordinator only (it plans the cluster and exits); "
                       "a --pp-peer has nothing to plan")


def test_bring_up_roles_fail_closed_without_a_secret(tmp_path, capsys, tiny_llama, monkeypatch):
    monkeypatch.delenv("MLXCEL_CLUSTER_SECRET", raising=False)
    monkeypatch.delenv("MLXCEL_CLUSTER_SECRET_FILE", raising=False)
    with socket.socket() as taken:
        taken.bind(("127.0.0.3", 0))
        taken.listen()
        for role in (["--pp-auto", "1", "--cluster-peers", "127.0.0.4:19001"],
                     ["--pp-peer", "--cluster-control-addr", "127.0.0.4:19001"]):
            message = error_of(capsys, "-m", str(tiny_llama), "--host", "127.0.0.3",
                               "--port", str(taken.getsockname()[1]), *role)
            assert message.startswith("a cluster secret is required but none was configured: pass --cluster-secret-file")


def test_defaults_follow_the_reference():
    coordinator = bringup_settings(parsed("--pp-auto", "2", "--host", "10.0.0.5", "--cluster-peers",
                                          "10.0.0.7:19001,10.0.0.6:19001"))
    assert coordinator.control == PeerId.of("10.0.0.5", DEFAULT_CONTROL_PORT) and DEFAULT_CONTROL_PORT == 19000
    assert (coordinator.cluster, coordinator.discovery, str(coordinator.config_path())) == (
        "mlxcel-cluster", "static", ".mlxcel/cluster.toml")
    peer = bringup_settings(parsed("--pp-peer", "--cluster-discovery", "mdns"))
    assert peer.control == PeerId.of("0.0.0.0", 0)  # an OS-assigned port, announced in the beacons
    assert (peer.discovery_target, peer.discovery_port) == (DEFAULT_DISCOVERY_TARGET, DEFAULT_DISCOVERY_PORT)
    assert (DEFAULT_DISCOVERY_TARGET, DEFAULT_DISCOVERY_PORT) == ("255.255.255.255", 49555)
    assert str(peer.config_path("stage-1")) == ".mlxcel/cluster-stage-1.toml"
    # --pp-peer with a cluster TOML is that TOML's node: the bring-up flags are not read
    args = parsed("--pp-peer", "--distributed-config", "c.toml", "--node-id", "stage-0")
    from mlxcel.commands.serve import check_cluster_flags

    check_cluster_flags(args)
