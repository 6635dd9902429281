"""The role table: which process a configuration starts, and the module that runs it.

Module map: ``context`` (``ServeConfig``, ``RoleContext``: what a role receives), then one module per
role, named after it: ``single``, ``coordinator``, ``stage``, ``pp_auto``, ``pp_peer``, ``prefill``,
``decode``, ``router``, ``tp``, ``tp_rank``. Each defines two hooks:

- ``configure(args, config) -> ServeConfig``: the role's own settings and preflight (the cluster
  secret, its flags), before any socket is bound; the only place a role reads the command line;
- ``run(context: RoleContext) -> int``: serve until stopped; the exit code.

Selection is explicit: every entry says which configurations claim it, and exactly one may (two
that do are refused by name); a configuration no entry claims is ``single``. A module is imported
only when its role is chosen, and only ``mlxcel/roles/`` and ``mlxcel/commands/`` import a role.
"""

from __future__ import annotations

import argparse
import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Callable

from mlxcel.errors import CLIError
from mlxcel.topology.names import ROLE_NAMES

if TYPE_CHECKING:
    from mlxcel.roles.context import RoleContext, ServeConfig
    from mlxcel.topology.distributed import Distributed

Claim = Callable[[argparse.Namespace, "Distributed | None"], bool]


@dataclass(frozen=True)
class Role:
    """One kind of process: the configurations that claim it, its module, what its HTTP port serves."""

    name: str
    claims: Claim
    serves_api: bool = True  # False: the port answers only /health, so it needs no API key

    @property
    def module(self) -> str:
        return f"mlxcel.roles.{self.name.replace('-', '_')}"

    def _hooks(self) -> ModuleType:
        return importlib.import_module(self.module)

    def configure(self, args: argparse.Namespace, config: ServeConfig) -> ServeConfig:
        return self._hooks().configure(args, config)

    def run(self, context: RoleContext) -> int:
        """Serve as this role: the process is a serving one from here on (``mlxcel.cluster.attribution``)."""
        from mlxcel.cluster.attribution import enter_role

        enter_role(self.name)
        return self._hooks().run(context)


def _node(role: str) -> Claim:
    """A cluster TOML node of this role (``--distributed-config`` + ``--node-id``)."""
    return lambda args, dist: dist is not None and dist.node.role == role


def _flag(name: str) -> Claim:
    """A zero-config flag, without a cluster TOML (a --pp-peer with one is that TOML's node)."""
    return lambda args, dist: dist is None and bool(getattr(args, name, None))


def _disagg(role: str) -> Claim:
    """A disaggregated role: the TOML node's role, else ``--node-role``."""
    return lambda args, dist: (dist.node.role if dist is not None else getattr(args, "node_role", None)) == role


def _tensor_parallel(follower: bool) -> Claim:
    """--tp-size above 1 without a cluster TOML: rank 0 serves the API, --tp-rank above 0 follows it."""
    return lambda args, dist: (dist is None and getattr(args, "tp_size", 1) > 1
                               and ((getattr(args, "tp_rank", None) or 0) > 0) == follower)


def _nothing_else(args: argparse.Namespace, dist: Distributed | None) -> bool:
    return False  # single is what no other entry claims (--node-role hybrid, the default, included)


ROLES: dict[str, Role] = {role.name: role for role in (
    Role("single", _nothing_else),
    Role("coordinator", _node("coordinator")),
    Role("stage", _node("stage"), serves_api=False),
    Role("pp-auto", _flag("pp_auto")),
    Role("pp-peer", _flag("pp_peer"), serves_api=False),
    Role("prefill", _disagg("prefill"), serves_api=False),
    Role("decode", _disagg("decode"), serves_api=False),
    Role("router", _disagg("router")),
    Role("tp", _tensor_parallel(follower=False)),
    Role("tp-rank", _tensor_parallel(follower=True), serves_api=False),
)}
assert tuple(ROLES) == ROLE_NAMES, "mlxcel/topology/names.py lists the roles in the table's order"


def select_role(args: argparse.Namespace, dist: Distributed | None, roles: dict[str, Role] = ROLES) -> Role:
    """The one role this configuration claims, else ``single``; ``CLIError`` when two claim it."""
    claimed = [role for role in roles.values() if role.claims(args, dist)]
    if len(claimed) > 1:
        raise CLIError(f"this configuration names {len(claimed)} roles ({', '.join(r.name for r in claimed)}); "
                       "a process plays one")
    if claimed:
        return claimed[0]
    if dist is not None:
        raise CLIError(f"no process role for node {dist.node.id!r} (role {dist.node.role!r}); "
                       f"known roles: {', '.join(roles)}")
    return roles["single"]
