"""The role table: which process a configuration starts, and the module that runs it (named entrypoints,
not roles, so it is not read as Ansible's ``roles/`` at the repository root).

Module map: ``context`` (``ServeConfig``, ``RoleContext``: what a role receives), then one module per
role, named after it: ``single``, ``coordinator``, ``stage``, ``pp_auto``, ``pp_peer``, ``prefill``,
``decode``, ``router``, ``tp``, ``tp_rank``; ``disagg_node`` is the prefill and decode processes' shell (the
model loading while /health says how it goes). Each role module defines two hooks:

- ``configure(flags, config) -> ServeConfig``: the role's own settings and preflight from its typed
  flags (``ServeFlags``, checked once by the command), before any socket is bound;
- ``run(context: RoleContext) -> int``: serve until stopped; the exit code.

Selection is explicit: every entry says which configurations claim it, and exactly one may (two
that do are refused by name); a configuration no entry claims is ``single``. A module is imported
only when its role is chosen, and only ``mlxcel/entrypoints/`` and ``mlxcel/commands/`` import a role.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Callable

from mlxcel.errors import CLIError
from mlxcel.topology.names import ROLE_NAMES

if TYPE_CHECKING:
    from mlxcel.entrypoints.flags import ServeFlags
    from mlxcel.entrypoints.context import RoleContext, ServeConfig
    from mlxcel.topology.distributed import Distributed

Claim = Callable[["ServeFlags", "Distributed | None"], bool]


@dataclass(frozen=True)
class Role:
    """One kind of process: the configurations that claim it, its module, what its HTTP port serves."""

    name: str
    claims: Claim
    serves_api: bool = True  # False: the port answers only /health, so it needs no API key

    @property
    def module(self) -> str:
        return f"mlxcel.entrypoints.{self.name.replace('-', '_')}"

    def _hooks(self) -> ModuleType:
        return importlib.import_module(self.module)

    def configure(self, flags: ServeFlags, config: ServeConfig) -> ServeConfig:
        return self._hooks().configure(flags, config)

    def run(self, context: RoleContext) -> int:
        """Serve as this role: the process is a serving one from here on (``mlxcel.cluster.attribution``)."""
        from mlxcel.cluster.attribution import enter_role

        enter_role(self.name)
        return self._hooks().run(context)


def _node(role: str) -> Claim:
    """A cluster TOML node of this role (``--distributed-config`` + ``--node-id``)."""
    return lambda args, dist: dist is not None and dist.node.role == role


def _bringup(coordinator: bool) -> Claim:
    """A zero-config flag (--pp-auto, --pp-peer), without a cluster TOML (a --pp-peer with one is that TOML's node)."""
    return lambda flags, dist: dist is None and bool(flags.bringup.pp_auto if coordinator else flags.bringup.pp_peer)


def _disagg(role: str) -> Claim:
    """A disaggregated role: the TOML node's role, else ``--node-role``."""
    return lambda flags, dist: (dist.node.role if dist is not None else flags.disagg.node_role) == role


def _tensor_parallel(follower: bool) -> Claim:
    """--tp-size above 1 without a cluster TOML: rank 0 serves the API, --tp-rank above 0 follows it."""
    return lambda flags, dist: (dist is None and flags.tp.tp_size > 1
                                and ((flags.tp.tp_rank or 0) > 0) == follower)


def _nothing_else(flags: ServeFlags, dist: Distributed | None) -> bool:
    return False  # single is what no other entry claims (--node-role hybrid, the default, included)


ROLES: dict[str, Role] = {role.name: role for role in (
    Role("single", _nothing_else),
    Role("coordinator", _node("coordinator")),
    Role("stage", _node("stage"), serves_api=False),
    Role("pp-auto", _bringup(coordinator=True)),
    Role("pp-peer", _bringup(coordinator=False), serves_api=False),
    Role("prefill", _disagg("prefill"), serves_api=False),
    Role("decode", _disagg("decode"), serves_api=False),
    Role("router", _disagg("router")),
    Role("tp", _tensor_parallel(follower=False)),
    Role("tp-rank", _tensor_parallel(follower=True), serves_api=False),
)}
assert tuple(ROLES) == ROLE_NAMES, "mlxcel/topology/names.py lists the roles in the table's order"


def select_role(flags: ServeFlags, dist: Distributed | None, roles: dict[str, Role] = ROLES) -> Role:
    """The one role this configuration claims, else ``single``; ``CLIError`` when two claim it."""
    claimed = [role for role in roles.values() if role.claims(flags, dist)]
    if len(claimed) > 1:
        raise CLIError(f"this configuration names {len(claimed)} roles ({', '.join(r.name for r in claimed)}); "
                       "a process plays one")
    if claimed:
        return claimed[0]
    if dist is not None:
        raise CLIError(f"no process role for node {dist.node.id!r} (role {dist.node.role!r}); "
                       f"known roles: {', '.join(roles)}")
    return roles["single"]
