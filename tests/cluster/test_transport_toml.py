"""The cluster TOML's [transport] table: the transport caps the reference names, bounded, and reaching the
listener of the node that reads the TOML (real sockets on loopback)."""

from __future__ import annotations

import socket

import pytest

from mlxcel.cluster.options import TransportOptions
from mlxcel.topology.cluster_config import ClusterConfigError, load_cluster_config
from tests.cluster.conftest import CLIENT_IP, HONEST_IP
from tests.cluster.test_attacks import _closed_at_accept as closed_at_accept
from tests.pipeline.cluster_toml import write_toml
from tests.ports import free_port
from tests.waiting import wait_until

COORDINATOR_IP = "127.0.0.2"


def nodes(port: int = 19000) -> str:
    return (f'[[nodes]]\nid = "coordinator"\nrole = "coordinator"\naddress = "{COORDINATOR_IP}:{port}"\n'
            '[[nodes]]\nid = "stage-0"\nrole = "stage"\naddress = "127.0.0.3:19001"\n')


def toml_with(tmp_path, transport: str, port: int = 19000):
    return write_toml(tmp_path, f"[transport]\n{transport}\n" + nodes(port))


def test_defaults_are_the_reference_caps(tmp_path):
    options = load_cluster_config(write_toml(tmp_path, nodes())).transport_options()
    assert options == TransportOptions()
    assert (options.max_connections, options.max_pending_handshakes, options.max_pending_handshakes_per_ip,
            options.handshake_timeout) == (512, 64, 8, 5.0)


def test_every_key_reaches_the_options(tmp_path):
    text = ("max_connections = 1024\nmax_pending_handshakes = 128\nmax_pending_handshakes_per_ip = 32\n"
            "handshake_timeout_s = 2.5\nmax_reconnect_attempts = 9\nreconnect_base_delay_s = 0.25")
    options = load_cluster_config(toml_with(tmp_path, text)).transport_options()
    assert (options.max_connections, options.max_pending_handshakes, options.max_pending_handshakes_per_ip,
            options.handshake_timeout, options.max_reconnect_attempts, options.reconnect_base_delay) == (
        1024, 128, 32, 2.5, 9, 0.25)


@pytest.mark.parametrize("text,message", [
    ("max_connections = 0", "max_connections under [transport] must be an integer from 1 to 65536, got 0"),
    ("max_connections = 70000", "max_connections under [transport] must be an integer from 1 to 65536, got 70000"),
    ("max_pending_handshakes = true", "max_pending_handshakes under [transport] must be an integer from 1 to 65536, "
                                      "got True"),
    ("max_pending_handshakes_per_ip = 0", "max_pending_handshakes_per_ip under [transport] must be an integer from "
                                          "1 to 65536, got 0"),
    ("max_pending_handshakes = 4\nmax_pending_handshakes_per_ip = 8",
     "max_pending_handshakes_per_ip under [transport] (8) cannot exceed max_pending_handshakes (4)"),
    ("max_pending_handshakes_per_ip = 65", "max_pending_handshakes_per_ip under [transport] (65) cannot exceed "
                                           "max_pending_handshakes (64)"),
    ("handshake_timeout_s = 0", "handshake_timeout_s under [transport] must be a number of seconds above 0 and at "
                                "most 300, got 0"),
    ("handshake_timeout_s = 301", "handshake_timeout_s under [transport] must be a number of seconds above 0 and at "
                                  "most 300, got 301"),
    ("handshake_timeout_s = \"5\"", "handshake_timeout_s under [transport] must be a number of seconds"),
    ("max_reconnect_attempts = -1", "max_reconnect_attempts under [transport] must be an integer from 0 to 100, "
                                    "got -1"),
    ("reconnect_base_delay_s = 6", "reconnect_base_delay_s under [transport] must be a number of seconds above 0 "
                                   "and at most 5, got 6"),
    ("max_frame_len = 1", "unknown key(s) max_frame_len in [transport] (known: handshake_timeout_s, "
                          "max_connections, max_pending_handshakes, max_pending_handshakes_per_ip, "
                          "max_reconnect_attempts, reconnect_base_delay_s)"),
])
def test_bad_values_are_refused_naming_file_and_key(tmp_path, text, message):
    path = toml_with(tmp_path, text)
    with pytest.raises(ClusterConfigError) as err:
        load_cluster_config(path)
    assert str(err.value).startswith(f"{path}: {message}"), str(err.value)


def test_a_disaggregated_toml_takes_the_table_too(tmp_path):
    text = "[transport]\nmax_pending_handshakes_per_ip = 2\n" + "\n".join(
        f'[[nodes]]\nid = "{role}-0"\nrole = "{role}"\naddress = "127.0.0.{i}:1900{i}"'
        for i, role in enumerate(("router", "prefill", "decode"), start=2)) + "\n"
    assert load_cluster_config(write_toml(tmp_path, text)).transport_options().max_pending_handshakes_per_ip == 2


@pytest.mark.timeout(30)
def test_per_source_pending_limit_from_the_toml_reaches_the_coordinator_listener(tmp_path, tiny_llama):
    """max_pending_handshakes_per_ip = 1: the coordinator's listener keeps one unauthenticated socket from a
    source and closes the second at accept; another source still gets its slot."""
    from mlxcel.cluster.secret import ClusterSecret
    from mlxcel.models.facts import model_facts
    from mlxcel.pipeline.coordinator import PipelineExecutor

    port = free_port(COORDINATOR_IP)
    cluster = load_cluster_config(toml_with(tmp_path, "max_pending_handshakes_per_ip = 1", port))
    executor = PipelineExecutor(cluster, ClusterSecret(b"k" * 32, source="test"), model_facts(tiny_llama),
                                max_batch_size=1)
    opened: list[socket.socket] = []
    try:
        assert executor.transport.options.max_pending_handshakes_per_ip == 1
        executor.transport.serve(lambda m: None, lambda m: b"")
        target = (COORDINATOR_IP, port)
        opened.append(socket.create_connection(target, source_address=(CLIENT_IP, 0)))
        assert wait_until(lambda: executor.transport.pending_handshakes == 1)
        opened.append(socket.create_connection(target, source_address=(CLIENT_IP, 0)))
        assert closed_at_accept(opened[-1], 2.0)  # the second pending socket from the same source
        opened.append(socket.create_connection(target, source_address=(HONEST_IP, 0)))
        assert wait_until(lambda: executor.transport.pending_handshakes == 2)  # another source's slot
        assert not closed_at_accept(opened[0], 0.2)  # the first one still waits for its hello
    finally:
        for s in opened:
            s.close()
        executor.close()


def test_a_disaggregated_node_from_the_toml_gets_the_table(tmp_path, tiny_llama):
    from mlxcel.cluster.secret import ClusterSecret
    from mlxcel.commands.serve import as_flags
    from mlxcel.disagg.flags import node_config
    from mlxcel.disagg.service import role_transport
    from mlxcel.cli import build_parser
    from mlxcel.topology.distributed import Distributed

    text = "[transport]\nmax_pending_handshakes_per_ip = 2\nhandshake_timeout_s = 3\n" + "\n".join(
        f'[[nodes]]\nid = "{role}-0"\nrole = "{role}"\naddress = "127.0.0.{i}:1900{i}"'
        for i, role in enumerate(("router", "prefill", "decode"), start=2)) + "\n"
    cluster = load_cluster_config(write_toml(tmp_path, text))
    dist = Distributed(cluster, cluster.node("router-0"))
    args = as_flags(build_parser().parse_args(["serve", "-m", str(tiny_llama), "--distributed-config", "x",
                                               "--node-id", "router-0"]))
    transport = role_transport(node_config(args.disagg, dist), ClusterSecret(b"k" * 32, source="test"))
    try:
        assert (transport.options.max_pending_handshakes_per_ip, transport.options.handshake_timeout,
                transport.options.reconnect_budget) == (2, 3.0, 0)
    finally:
        transport.close()
