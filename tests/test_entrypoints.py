"""The role table picks the process from the parsed flags and cluster TOML, before anything listens."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from mlxcel.cli import build_parser
from mlxcel.errors import CLIError
from mlxcel.commands.serve import as_flags, cluster_node
from mlxcel.entrypoints import ROLES, Role, select_role
from mlxcel.topology.names import ROLE_NAMES
from tests.pipeline.cluster import LocalCluster

pytestmark = pytest.mark.proc  # starts processes (tests/proc_marker.py)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_llama) -> LocalCluster:
    """A rendered cluster TOML and secret for two stages (nothing started)."""
    return LocalCluster(tmp_path_factory.mktemp("roles"), tiny_llama)


def prepared(cluster: LocalCluster, node_id: str | None):
    argv = ["serve", "-m", str(cluster.model)]
    if node_id is not None:
        argv += ["--distributed-config", str(cluster.toml), "--node-id", node_id]
    args = as_flags(build_parser().parse_args(argv))
    return args, cluster_node(args, Path(args.server.model))


@pytest.mark.parametrize("node_id,role,serves_api", [
    (None, "single", True),
    ("coordinator", "coordinator", True),
    ("stage-0", "stage", False),
    ("stage-1", "stage", False),
])
def test_configuration_selects_its_role(cluster, node_id, role, serves_api):
    args, dist = prepared(cluster, node_id)
    selected = select_role(args, dist)
    assert (selected.name, selected.serves_api) == (role, serves_api)


@pytest.mark.parametrize("flags,role,serves_api", [
    (["--pp-auto", "2", "--cluster-peers", "127.0.0.3:19001,127.0.0.4:19001"], "pp-auto", True),
    (["--pp-peer", "--cluster-control-addr", "127.0.0.3:19001"], "pp-peer", False),
])
def test_bringup_flags_select_their_role(cluster, flags, role, serves_api):
    args = as_flags(build_parser().parse_args(["serve", "-m", str(cluster.model), *flags]))
    selected = select_role(args, cluster_node(args, Path(args.server.model)))
    assert (selected.name, selected.serves_api) == (role, serves_api)


def test_a_peer_with_a_cluster_toml_skips_the_wait(cluster):
    """--pp-peer with --distributed-config and --node-id is that TOML's node: no assignment wait."""
    args, dist = prepared(cluster, "stage-1")
    args = replace(args, bringup=replace(args.bringup, pp_peer=True))
    assert select_role(args, dist).name == "stage"


def test_every_role_is_one_module_named_after_it_with_both_hooks():
    assert tuple(ROLES) == ROLE_NAMES
    for name, role in ROLES.items():
        module = importlib.import_module(role.module)
        assert module.__name__ == f"mlxcel.entrypoints.{name.replace('-', '_')}"
        assert callable(module.configure) and callable(module.run), role.module


def test_a_node_no_role_serves_is_one_clear_error(cluster):
    args, dist = prepared(cluster, "coordinator")
    dist = replace(dist, node=replace(dist.node, role="archivist"))  # a node role no entry selects
    known = ", ".join(ROLES)  # every entry, in table order
    with pytest.raises(CLIError, match=r"^no process role for node 'coordinator' \(role 'archivist'\); "
                                       rf"known roles: {re.escape(known)}$"):
        select_role(args, dist)
    assert known.startswith("single, coordinator, stage, ")


@pytest.mark.parametrize("flags,role,serves_api", [
    (["--tp-size", "2"], "tp", True),
    (["--tp-size", "2", "--tp-hostfile", "h.json", "--tp-rank", "0"], "tp", True),
    (["--tp-size", "2", "--tp-hostfile", "h.json", "--tp-rank", "1"], "tp-rank", False),
    (["--tp-size", "1"], "single", True),
])
def test_tensor_parallel_flags_select_rank_0_or_a_follower(flags, role, serves_api):
    args = as_flags(build_parser().parse_args(["serve", *flags]))
    selected = select_role(args, None)
    assert (selected.name, selected.serves_api) == (role, serves_api)


def test_selection_does_not_depend_on_the_table_order(cluster):
    """A new role is one entry; where it stands in the table changes nothing."""
    archivist = Role("archivist", lambda args, dist: dist is not None and dist.node.role == "archivist")
    args, dist = prepared(cluster, "coordinator")
    as_archivist = replace(dist, node=replace(dist.node, role="archivist"))
    for table in ({"archivist": archivist, **ROLES}, {**ROLES, "archivist": archivist}):
        assert select_role(args, as_archivist, table) is archivist
        assert select_role(args, dist, table).name == "coordinator"
        assert select_role(args, None, table).name == "single"


def test_two_entries_that_claim_one_configuration_are_refused_by_name(cluster):
    greedy = Role("greedy", lambda args, dist: dist is not None)
    args, dist = prepared(cluster, "coordinator")
    with pytest.raises(CLIError, match=r"^this configuration names 2 roles \(coordinator, greedy\); a process plays one$"):
        select_role(args, dist, {**ROLES, "greedy": greedy})


def test_a_role_module_is_imported_only_when_selected():
    """The table names modules; a stage process never loads the OpenAI app, nor the other roles."""
    code = ("import sys, importlib, mlxcel.commands.serve, mlxcel.entrypoints as r\n"
            "print(sorted(x.module for x in r.ROLES.values() if x.module in sys.modules))\n"
            "importlib.import_module(r.ROLES['stage'].module)\n"
            "print(sorted(m for m in ('mlxcel.server.app', 'mlxcel.server.openai_process', *(x.module for x in r.ROLES.values()))"
            " if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.splitlines() == ["[]", "['mlxcel.entrypoints.stage']"]
