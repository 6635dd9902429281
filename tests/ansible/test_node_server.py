"""The node TOML's [server] table (mlxcel/node/server.py) without Ansible: the argv it builds and what it refuses."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxcel.node.spec import NodeSpecError, parse_node_spec

BASE = {"program": "/v/bin/mlxcel-server", "model": "/m", "host": "127.0.0.3", "port": 8080, "args": []}


def _spec(server: dict, **top: object):
    return parse_node_spec({"server": server, **top}, Path("/h/node.toml"))


def test_a_single_server_and_the_match_of_its_address() -> None:
    spec = _spec({**BASE, "threads": 2, "args": ["--parallel", "8"]})
    assert spec.command == ("/v/bin/mlxcel-server", "-m", "/m", "--host", "127.0.0.3", "--port", "8080",
                            "--threads", "2", "--parallel", "8")
    assert spec.match == "--host 127.0.0.3 --port 8080"


def test_a_pp_auto_peer_gets_no_coordinator_flag() -> None:
    cluster = {"secret_file": "/s", "bringup": "pp_auto", "role": "stage", "peers": ["a:1"], "control_addr": "b:1",
               "config_out": "/h/cluster-{node_id}.toml", "name": "demo", "micro_batch_size": 4}
    assert _spec({**BASE, "cluster": cluster}).command[3:] == (
        "--pp-peer", "--cluster-control-addr", "b:1", "--cluster-config-out", "/h/cluster-{node_id}.toml",
        "--cluster-name", "demo", "--cluster-secret-file", "/s", "--host", "127.0.0.3", "--port", "8080")


COORDINATOR = {"secret_file": "/s", "bringup": "pp_auto", "role": "coordinator", "peers": ["a:1", "b:1"],
               "control_addr": "c:1", "config_out": "/h/cluster.toml"}


def test_a_pp_auto_coordinator_with_spares_lists_them_after_the_stages() -> None:
    cluster = {**COORDINATOR, "spares": ["d:1"], "spare_after_s": 3}
    assert _spec({**BASE, "cluster": cluster}).command[3:13] == (
        "--pp-auto", "2", "--cluster-peers", "a:1,b:1,d:1", "--pp-spare", "1", "--pp-spare-after", "3",
        "--cluster-control-addr", "c:1")
    assert "--pp-spare" not in _spec({**BASE, "cluster": {**COORDINATOR, "spares": []}}).command  # none: no flag


@pytest.mark.parametrize("cluster, error", [
    ({**COORDINATOR, "spares": "d:1"}, "spares must be a list of non-empty strings"),
    ({**COORDINATOR, "spares": ["a:1"]}, "spares a:1 also in peers (a host is a stage or a spare)"),
    ({**COORDINATOR, "spare_after_s": 3}, "spare_after_s needs spares (with no spare there is nothing to assign)"),
    ({**COORDINATOR, "spares": ["d:1"], "spare_after_s": 0}, "spare_after_s must be a positive number, got 0"),
    ({**COORDINATOR, "spares": ["d:1"], "spare_after_s": True}, "spare_after_s must be a positive number, got True"),
    ({**COORDINATOR, "role": "stage", "spares": ["d:1"]}, "spares and spare_after_s are the coordinator's"),
    ({**COORDINATOR, "bringup": "toml", "node_id": "x", "config": "/c", "spares": ["d:1"]},
     "spares and spare_after_s need bringup pp_auto"),
])
def test_spares_refused_with_the_key_named(cluster: dict, error: str) -> None:
    with pytest.raises(NodeSpecError) as refused:
        _spec({**BASE, "cluster": cluster})
    assert error in str(refused.value) and "/h/node.toml" in str(refused.value)


@pytest.mark.parametrize("server, top, error", [
    ({**BASE, "ssl_certfile": "/c"}, {}, "ssl_certfile and ssl_keyfile go together"),
    ({**BASE, "port": "8080"}, {}, "[server] port must be a positive integer"),
    ({**BASE, "flags": []}, {}, "unknown key(s) flags in [server]"),
    ({**BASE, "cluster": {"secret_file": "/s", "bringup": "static"}}, {}, "bringup must be one of toml, pp_auto"),
    ({**BASE, "cluster": {"secret_file": "/s", "bringup": "toml", "config": "/c"}}, {}, "node_id must be"),
    (BASE, {"command": ["/bin/true"]}, "command and [server] both describe the command line"),
])
def test_refused_with_the_key_named(server: dict, top: dict, error: str) -> None:
    with pytest.raises(NodeSpecError) as refused:
        _spec(server, **top)
    assert error in str(refused.value) and "/h/node.toml" in str(refused.value)
