"""Role ``decode``: adopt KV handoffs and stream tokens to the router; /health on --host/--port."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from mlxcel.disagg.flags import node_config
from mlxcel.entrypoints.disagg_node import run_worker
from mlxcel.entrypoints.context import RoleContext, ServeConfig

if TYPE_CHECKING:
    from mlxcel.entrypoints.flags import ServeFlags


def configure(flags: ServeFlags, config: ServeConfig) -> ServeConfig:
    """The node's addresses and peers (flags or the cluster TOML; the secret is the command's, fail closed)."""
    return replace(config, disagg=node_config(flags.disagg, config.dist, flags.resume.max_resumes,
                                              flags.resume.resume_timeout, flags.server.max_queue))


def run(context: RoleContext) -> int:
    assert context.config.disagg is not None  # configure set it
    assert context.config.secret is not None  # every disaggregated role needs it (fail closed)
    return run_worker(context.endpoint, context.config.server, context.config.disagg, context.config.secret)
