"""Role ``tp-rank``: a follower rank of a hostfile group (``mlxcel-server --tp-hostfile F --tp-rank R``, R > 0).

It joins rank 0 at the hostfile's control address with the cluster secret (required: the control
channel crosses hosts), shards the model and replays rank 0's steps until rank 0 stops it. It serves
no HTTP: the port ``--host``/``--port`` bound is closed at once (rank 0 serves the API).
"""

from __future__ import annotations

from pathlib import Path

from mlxcel.process import RoleContext


def run(context: RoleContext) -> int:
    """Follow rank 0 until its shutdown (0) or a failure (exits 1 with one line)."""
    from mlxcel.cluster.secret import load_secret
    from mlxcel.models.loading import check_checkpoint
    from mlxcel.parallel.follower import follow_hostfile
    from mlxcel.parallel.options import prepare_tp

    model = Path(context.config.model)
    tp = prepare_tp(context.args, model, check_checkpoint(model))
    assert tp is not None
    secret = load_secret(context.args.cluster_secret_file, required=True)
    context.sock.close()
    return follow_hostfile(tp, model, secret)
