"""Bring a cluster node up from ``--distributed-config FILE --node-id ID``: what a stage or the coordinator
needs before it starts (the role table, ``mlxcel/roles.py``, picks which by the node's role).

Order of checks, before anything listens: the TOML loads, the node exists, the secret is there
(fail closed: a pipeline of 2 or more stages refuses to start without one, naming every source),
the stage ranges cover the checkpoint (or are planned from its parameter bytes).
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from pathlib import Path

from mlxcel.cluster.secret import ClusterSecret, load_secret
from mlxcel.errors import CLIError
from mlxcel.pipeline.cluster_config import (
    ClusterConfig,
    ClusterConfigError,
    Node,
    load_cluster_config,
)
from mlxcel.pipeline.stage import ModelFacts

log = logging.getLogger("mlxcel.pipeline")


@dataclass(frozen=True)
class Distributed:
    """This process's place in a cluster."""

    cluster: ClusterConfig
    node: Node
    secret: ClusterSecret | None
    micro_batch_size: int | None = None
    return_logits: bool = False


def model_facts(model_dir: Path) -> ModelFacts:
    from mlxcel.models.identity import layer_count, model_identity, read_config

    _, config = read_config(model_dir)
    text = config.get("text_config") or config
    return ModelFacts(identity=model_identity(model_dir), num_layers=layer_count(config),
                      hidden_size=int(text["hidden_size"]), vocab_size=int(text["vocab_size"]))


def resolve_layers(cluster: ClusterConfig, model_dir: Path, num_layers: int) -> ClusterConfig:
    """Stage ranges from the TOML (checked against the model) or planned by parameter bytes."""
    if not cluster.stages:  # a disaggregated cluster: every node holds the whole model
        return cluster
    if all(n.layers is None for n in cluster.stages):
        from mlxcel.pipeline.partition import layer_costs, plan_stages

        stages = plan_stages(layer_costs(model_dir), len(cluster.stages))
        cluster = cluster.with_layers([(s.start, s.end) for s in stages])
    cluster.check_layers(num_layers)
    return cluster


def prepare_distributed(args: argparse.Namespace, model_dir: Path) -> Distributed | None:
    """Load and check everything a cluster node needs before it binds a socket; None without a TOML."""
    if getattr(args, "distributed_config", None) is None:
        return None
    try:
        cluster = load_cluster_config(args.distributed_config)
        node = cluster.node(args.node_id)
        facts = model_facts(model_dir)
        cluster = resolve_layers(cluster, model_dir, facts.num_layers)
        node = cluster.node(args.node_id)
    except ClusterConfigError as exc:
        raise CLIError(str(exc)) from None
    # Fail closed: every cluster connection is authenticated, so no node starts without the secret.
    secret = load_secret(args.cluster_secret_file, toml_secret_file=cluster.secret_file, required=True)
    return Distributed(cluster, node, secret, micro_batch_size=getattr(args, "pp_micro_batch_size", None),
                       return_logits=getattr(args, "pp_return_logits", False))


def load_stage_runner(model_dir: Path, start: int, end: int, *, max_rows: int):
    """The stage's layers only: the checkpoint loads lazily and only this slice's weights are evaluated,
    so the other layers are never read from disk (MLX loads an array's data when it is first evaluated)."""
    import mlx.core as mx

    from mlxcel.engine.executor import slice_runner
    from mlxcel.models.loading import load_checkpoint

    loaded = load_checkpoint(model_dir, lazy=True)
    model = loaded.model
    runner = slice_runner(model, start, end, max_rows=max_rows)
    inner = model.model
    keep = [layer.parameters() for layer in inner.layers[start:end]]
    last = end == len(inner.layers)
    head = getattr(model, "lm_head", None)
    if start == 0 or (last and head is None):  # the first stage embeds; a tied head reuses the embedding
        keep.append(inner.embed_tokens.parameters())
    if last:
        keep.append(inner.norm.parameters())
        if head is not None:
            keep.append(head.parameters())
    mx.eval(keep)
    return runner, loaded
