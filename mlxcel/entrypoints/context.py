"""What a role receives: the serve command's flags parsed once into ``ServeConfig``, and its endpoint.

``mlxcel/commands/serve.py`` builds the configuration from the typed flags (``ServeFlags``, checked once):
the settings every role shares, then the chosen role's own ``configure`` hook (its bring-up,
disaggregated or tensor-parallel settings), then the cluster secret, loaded once. A role's ``run`` reads
only this, never the command line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mlxcel.config import DEFAULT_DRAIN_TIMEOUT_S
from mlxcel.process import Endpoint
from mlxcel.topology.distributed import Distributed, PipelineOptions

if TYPE_CHECKING:
    from mlxcel.bringup.flags import BringupSettings
    from mlxcel.cluster.secret import ClusterSecret
    from mlxcel.disagg.flags import NodeConfig
    from mlxcel.parallel.options import TPOptions
    from mlxcel.pipeline.takeover import StageReplacer
    from mlxcel.server.access import AccessConfig
    from mlxcel.server.runtime import ServerConfig


@dataclass(frozen=True)
class ServeConfig:
    """Every flag of ``mlxcel serve`` / ``mlxcel-server``, checked; the role's section is filled by its hook."""

    role: str  # one of mlxcel.topology.names.ROLE_NAMES
    server: ServerConfig
    log_level: str = "info"
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    threads: int = 1  # threads one matrix product may use (already applied to the BLAS)
    pipeline: PipelineOptions = PipelineOptions()
    dist: Distributed | None = None  # --distributed-config: this node of the cluster TOML
    # the cluster secret: loaded once per process, by the command (fail closed where the role needs one), and held
    # here alone; never in a repr
    secret: ClusterSecret | None = field(default=None, repr=False)
    bringup: BringupSettings | None = None  # pp-auto, pp-peer
    disagg: NodeConfig | None = None  # prefill, decode, router
    tp: TPOptions | None = None  # tp, tp-rank
    replacer: StageReplacer | None = None  # coordinator after a --pp-auto push with --pp-spare: the spares


@dataclass(frozen=True)
class RoleContext:
    """Everything a role's ``run`` gets: its configuration, access control and the socket already bound."""

    config: ServeConfig
    access: AccessConfig
    endpoint: Endpoint

    def as_role(self, role: str, dist: Distributed) -> RoleContext:
        """This context for the cluster role a bring-up process becomes once its TOML exists."""
        from dataclasses import replace

        return replace(self, config=replace(self.config, role=role, dist=dist))
