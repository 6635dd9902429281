"""Role ``prefill``: run prompts and hand their KV caches to decode nodes; /health on --host/--port."""

from __future__ import annotations

import argparse
from dataclasses import replace

from mlxcel.disagg.flags import node_config
from mlxcel.disagg.worker import run_worker
from mlxcel.roles.context import RoleContext, ServeConfig


def configure(args: argparse.Namespace, config: ServeConfig) -> ServeConfig:
    """The node's addresses and peers (flags or the cluster TOML) and the cluster secret (fail closed)."""
    return replace(config, disagg=node_config(args, config.dist))


def run(context: RoleContext) -> int:
    assert context.config.disagg is not None  # configure set it
    return run_worker(context.endpoint, context.config.server, context.config.disagg)
