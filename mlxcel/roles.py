"""The role table: which process this configuration starts, and where that role's code lives.

``mlxcel serve`` / ``mlxcel-server`` checks flags, loads the cluster TOML if any, then asks
``select_role`` and runs what it returns. Entries are tried in order and the first whose ``selects``
holds wins, so a more specific entry goes before a more general one (``single`` is last).

A role is one module with ``run(context: RoleContext) -> int`` (``mlxcel/process.py``) plus one entry
here; the module is imported only when its role is selected, so roles never import each other.
"""

from __future__ import annotations

import argparse
import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from mlxcel.errors import CLIError

if TYPE_CHECKING:
    from mlxcel.pipeline.runtime import Distributed
    from mlxcel.process import RoleContext

Selector = Callable[[argparse.Namespace, "Distributed | None"], bool]


@dataclass(frozen=True)
class Role:
    """One kind of process: when it is chosen, which module runs it, what its HTTP port serves."""

    name: str
    selects: Selector
    module: str  # defines run(context: RoleContext) -> int
    serves_api: bool = True  # False: the port answers only /health, so it needs no API key

    def run(self, context: RoleContext) -> int:
        return importlib.import_module(self.module).run(context)


def _node_role(role: str) -> Selector:
    return lambda args, dist: dist is not None and dist.node.role == role


def _no_cluster(args: argparse.Namespace, dist: Distributed | None) -> bool:
    return dist is None


def _bringup(flag: str) -> Selector:
    """A zero-config role, chosen by its flag while no cluster TOML is loaded (a --pp-peer with
    --distributed-config and --node-id skips the wait: the TOML's node role selects it)."""
    return lambda args, dist: dist is None and bool(getattr(args, flag, None))


def _disagg(role: str) -> Selector:
    """A disaggregated role: the TOML node's role, else ``--node-role`` (docs/disagg.md)."""
    return lambda args, dist: (dist.node.role if dist is not None else getattr(args, "node_role", None)) == role


def _tensor_parallel(follower: bool) -> Selector:
    """--tp-size above 1 without a cluster TOML: rank 0 serves the API, --tp-rank above 0 follows it."""
    return lambda args, dist: (dist is None and getattr(args, "tp_size", 1) > 1
                               and ((getattr(args, "tp_rank", None) or 0) > 0) == follower)


ROLES: tuple[Role, ...] = (
    Role("stage", _node_role("stage"), "mlxcel.pipeline.stage_server", serves_api=False),
    Role("coordinator", _node_role("coordinator"), "mlxcel.pipeline.coordinator_server"),
    Role("pp-auto", _bringup("pp_auto"), "mlxcel.bringup.coordinator"),
    Role("pp-peer", _bringup("pp_peer"), "mlxcel.bringup.peer", serves_api=False),
    Role("prefill", _disagg("prefill"), "mlxcel.disagg.prefill_role", serves_api=False),
    Role("decode", _disagg("decode"), "mlxcel.disagg.decode_role", serves_api=False),
    Role("router", _disagg("router"), "mlxcel.disagg.router_role"),
    Role("tp-rank", _tensor_parallel(follower=True), "mlxcel.parallel.rank_server", serves_api=False),
    Role("tp", _tensor_parallel(follower=False), "mlxcel.parallel.server"),
    Role("single", _no_cluster, "mlxcel.server.single"),  # --node-role hybrid (the default) too
)


def select_role(args: argparse.Namespace, dist: Distributed | None, roles: tuple[Role, ...] = ROLES) -> Role:
    """The first role of ``roles`` whose selector holds; CLIError naming the node if none does."""
    for role in roles:
        if role.selects(args, dist):
            return role
    where = "this configuration" if dist is None else f"node {dist.node.id!r} (role {dist.node.role!r})"
    raise CLIError(f"no process role for {where}; known roles: {', '.join(r.name for r in roles)}")
