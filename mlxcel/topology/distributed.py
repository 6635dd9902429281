"""A cluster node's place in its cluster, from ``--distributed-config FILE --node-id ID``.

``load_distributed`` checks, before anything listens: the TOML loads, the node exists, the secret is
there (fail closed: every cluster connection is authenticated, so no node starts without one, and
the error names every source), the stage ranges cover the checkpoint (or are planned from its
parameter bytes). Every cluster role reads the result: stages, coordinator, prefill, decode, router.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mlxcel.cluster.secret import ClusterSecret, load_secret
from mlxcel.errors import CLIError
from mlxcel.topology.cluster_config import ClusterConfig, ClusterConfigError, Node, load_cluster_config


@dataclass(frozen=True)
class PipelineOptions:
    """The coordinator's pipeline flags (``--pp-micro-batch-size``, ``--pp-return-logits``, ``--pp-stop-stages``,
    and ``--max-resumes``/``--resume-timeout``, which override the TOML's ``max_resumes``/``resume_s``)."""

    micro_batch_size: int | None = None
    return_logits: bool = False
    stop_stages: bool = False
    max_resumes: int | None = None
    resume_timeout_s: float | None = None


@dataclass(frozen=True)
class Distributed:
    """This process's place in a cluster: the cluster TOML, its own node, the secret, the pipeline flags."""

    cluster: ClusterConfig
    node: Node
    secret: ClusterSecret | None
    options: PipelineOptions = PipelineOptions()

    @property
    def micro_batch_size(self) -> int | None:
        return self.options.micro_batch_size

    @property
    def return_logits(self) -> bool:
        return self.options.return_logits


def resolve_layers(cluster: ClusterConfig, model_dir: Path, num_layers: int) -> ClusterConfig:
    """Stage ranges from the TOML (checked against the model) or planned by parameter bytes."""
    if not cluster.stages:  # a disaggregated cluster: every node holds the whole model
        return cluster
    if all(n.layers is None for n in cluster.stages):
        from mlxcel.topology.partition import layer_costs, plan_stages

        stages = plan_stages(layer_costs(model_dir), len(cluster.stages))
        cluster = cluster.with_layers([(s.start, s.end) for s in stages])
    cluster.check_layers(num_layers)
    return cluster


def load_distributed(config_path: str | Path, node_id: str, model_dir: Path, *, secret_file: str | None = None,
                     options: PipelineOptions = PipelineOptions()) -> Distributed:
    """Everything a cluster node needs before it binds a socket; ``CLIError``/``SecretError`` on a problem."""
    from mlxcel.models.facts import model_facts

    try:
        cluster = load_cluster_config(config_path)
        cluster.node(node_id)
        cluster = resolve_layers(cluster, model_dir, model_facts(model_dir).num_layers)
        node = cluster.node(node_id)
    except ClusterConfigError as exc:
        raise CLIError(str(exc)) from None
    secret = load_secret(secret_file, toml_secret_file=cluster.secret_file, required=True)
    cluster = cluster.with_resume(options.max_resumes, options.resume_timeout_s)
    return Distributed(cluster, node, secret, options)


def from_toml(path: str | Path, node_id: str, secret: ClusterSecret,
              options: PipelineOptions = PipelineOptions()) -> Distributed:
    """The node ``node_id`` of a TOML that bring-up just wrote (its ranges are already planned)."""
    try:
        cluster = load_cluster_config(path).with_resume(options.max_resumes, options.resume_timeout_s)
        return Distributed(cluster, cluster.node(node_id), secret, options)
    except ClusterConfigError as exc:
        raise CLIError(str(exc)) from None
