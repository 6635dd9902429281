"""Role ``tp-rank``: a follower rank of a hostfile group (``mlxcel-server --tp-hostfile F --tp-rank R``, R > 0).

It joins rank 0 at the hostfile's control address with the cluster secret (required: the control
channel crosses hosts), shards the model and replays rank 0's steps until rank 0 stops it. It serves
no HTTP: the port ``--host``/``--port`` bound is closed at once (rank 0 serves the API).
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from dataclasses import replace
from pathlib import Path

from mlxcel.entrypoints.context import RoleContext, ServeConfig

if TYPE_CHECKING:
    from mlxcel.entrypoints.flags import ServeFlags


def configure(flags: ServeFlags, config: ServeConfig) -> ServeConfig:
    """The shard plan and the hostfile (checked before any weight is read); the command loads the cluster secret
    (required)."""
    from mlxcel.models.loading import check_checkpoint
    from mlxcel.parallel.options import prepare_tp

    tp = prepare_tp(flags.tp, config.server.model, check_checkpoint(config.server.model))
    assert tp is not None  # the role is chosen by --tp-size above 1
    return replace(config, tp=tp)


def run(context: RoleContext) -> int:
    """Follow rank 0 until its shutdown (0) or a failure (exits 1 with one line)."""
    from mlxcel.parallel.follower import follow_hostfile

    tp, secret = context.config.tp, context.config.secret
    assert tp is not None and secret is not None  # configure set them
    context.endpoint.sock.close()
    return follow_hostfile(tp, Path(context.config.server.model), secret)
