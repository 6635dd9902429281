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
from mlxcel.pipeline.runtime import prepare_distributed
from mlxcel.roles import ROLES, Role, select_role
from tests.pipeline.cluster import LocalCluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_llama) -> LocalCluster:
    """A rendered cluster TOML and secret for two stages (nothing started)."""
    return LocalCluster(tmp_path_factory.mktemp("roles"), tiny_llama)


def prepared(cluster: LocalCluster, node_id: str | None):
    argv = ["serve", "-m", str(cluster.model)]
    if node_id is not None:
        argv += ["--distributed-config", str(cluster.toml), "--node-id", node_id]
    args = build_parser().parse_args(argv)
    return args, prepare_distributed(args, Path(args.model))


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
    args = build_parser().parse_args(["serve", "-m", str(cluster.model), *flags])
    selected = select_role(args, prepare_distributed(args, Path(args.model)))
    assert (selected.name, selected.serves_api) == (role, serves_api)


def test_a_peer_with_a_cluster_toml_skips_the_wait(cluster):
    """--pp-peer with --distributed-config and --node-id is that TOML's node: no assignment wait."""
    args, dist = prepared(cluster, "stage-1")
    args.pp_peer = True
    assert select_role(args, dist).name == "stage"


def test_every_role_names_a_module_with_run():
    assert len({role.name for role in ROLES}) == len(ROLES)
    for role in ROLES:
        assert callable(importlib.import_module(role.module).run), role.module


def test_a_node_no_role_serves_is_one_clear_error(cluster):
    args, dist = prepared(cluster, "coordinator")
    dist = replace(dist, node=replace(dist.node, role="archivist"))  # a node role no entry selects
    known = ", ".join(role.name for role in ROLES)  # every entry, in table order
    with pytest.raises(CLIError, match=r"^no process role for node 'coordinator' \(role 'archivist'\); "
                                       rf"known roles: {re.escape(known)}$"):
        select_role(args, dist)
    assert known.startswith("stage, coordinator, ") and known.endswith(", single")


@pytest.mark.parametrize("flags,role,serves_api", [
    (["--tp-size", "2"], "tp", True),
    (["--tp-size", "2", "--tp-hostfile", "h.json", "--tp-rank", "0"], "tp", True),
    (["--tp-size", "2", "--tp-hostfile", "h.json", "--tp-rank", "1"], "tp-rank", False),
    (["--tp-size", "1"], "single", True),
])
def test_tensor_parallel_flags_select_rank_0_or_a_follower(flags, role, serves_api):
    args = build_parser().parse_args(["serve", *flags])
    selected = select_role(args, None)
    assert (selected.name, selected.serves_api) == (role, serves_api)


def test_first_matching_entry_wins(cluster):
    """A new role is one entry placed before the more general ones it narrows."""
    router = Role("router", lambda args, dist: dist is not None and dist.node.role == "router", "mlxcel.router")
    args, dist = prepared(cluster, "coordinator")
    as_router = replace(dist, node=replace(dist.node, role="router"))
    assert select_role(args, as_router, (router, *ROLES)) is router
    assert select_role(args, dist, (router, *ROLES)).name == "coordinator"
    assert select_role(args, None, (router, *ROLES)).name == "single"


def test_a_role_module_is_imported_only_when_selected():
    """The table names modules; a stage process never loads the OpenAI app, nor the other roles."""
    code = ("import sys, importlib, mlxcel.server.launch, mlxcel.roles as r\n"
            "print(sorted(x.module for x in r.ROLES if x.module in sys.modules))\n"
            "importlib.import_module(next(x.module for x in r.ROLES if x.name == 'stage'))\n"
            "print(sorted(m for m in ('mlxcel.server.app', 'mlxcel.server.serve', *(x.module for x in r.ROLES))"
            " if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.splitlines() == ["[]", "['mlxcel.pipeline.stage_server']"]
