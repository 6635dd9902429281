"""A cluster node's place in its cluster, from ``--distributed-config FILE --node-id ID``.

``load_distributed`` checks, before anything listens: the TOML loads, the node exists, ``--pp-layers``
agrees with the TOML, the stage ranges cover the checkpoint (or are planned from its parameter bytes).
``cluster_secret`` loads the secret (fail closed from two stages and on every disaggregated node, the
error naming every source; the reference's scope): once per process, by ``mlxcel/commands/serve.py``,
which holds it in ``ServeConfig.secret`` alone. Every cluster role reads the result: stages, coordinator, prefill, decode, router.
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
    """This process's place in a cluster: the cluster TOML, its own node, the pipeline flags (the secret is
    ``ServeConfig.secret``)."""

    cluster: ClusterConfig
    node: Node
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


def apply_layers_flag(cluster: ClusterConfig, text: str, num_layers: int) -> ClusterConfig:
    """``--pp-layers`` on a cluster TOML: one range per stage, covering the model (``mlxcel generate``'s texts);
    it sets the stages' layers where the TOML gives none and must equal them where it does."""
    from mlxcel.topology.partition import PartitionError, format_range, parse_layer_ranges

    if not cluster.stages:
        raise CLIError(f"--pp-layers sets the stage layers of a pipeline; {cluster.path} is a disaggregated cluster "
                       "(every node holds the whole model)")
    try:
        ranges = parse_layer_ranges(text, num_layers)
    except PartitionError as exc:
        raise CLIError(str(exc)) from None
    stages = len(cluster.stages)
    if len(ranges) != stages:
        raise CLIError(f"--pp-layers names {len(ranges)} stage{'s' if len(ranges) != 1 else ''} but {cluster.path} "
                       f"has {stages} (pipeline_parallel_size {cluster.pipeline_parallel_size})")
    given = [n.layers for n in cluster.stages]
    if all(r is not None for r in given) and given != ranges:
        shown = ",".join(format_range(*r) for r in given)  # type: ignore[misc]
        raise CLIError(f"--pp-layers {text.strip()} contradicts the stage layers of {cluster.path} ({shown}): give "
                       "the same ranges, or leave layers out of the TOML")
    return cluster.with_layers(ranges)


def load_distributed(config_path: str | Path, node_id: str, model_dir: Path, *,
                     options: PipelineOptions = PipelineOptions(), layers: str | None = None) -> Distributed:
    """Everything a cluster node needs before it binds a socket but the secret (``cluster_secret``);
    ``CLIError`` on a problem. ``layers`` is ``--pp-layers`` (``apply_layers_flag``)."""
    from mlxcel.models.facts import model_facts

    try:
        cluster = load_cluster_config(config_path)
        cluster.node(node_id)
        num_layers = model_facts(model_dir).num_layers
        if layers is not None:
            cluster = apply_layers_flag(cluster, layers, num_layers)
        cluster = resolve_layers(cluster, model_dir, num_layers)
        node = cluster.node(node_id)
    except ClusterConfigError as exc:
        raise CLIError(str(exc)) from None
    cluster = cluster.with_resume(options.max_resumes, options.resume_timeout_s)
    return Distributed(cluster, node, options)


def cluster_secret(dist: Distributed, secret_file: str | None) -> ClusterSecret | None:
    """The node's cluster secret (``SecretError`` names every source). Required (fail closed) from two stages and
    on every disaggregated node; a one-stage pipeline reads a configured one (a bad one is still an error) and
    starts without one (the reference's scope), but its stage and coordinator cannot connect without it."""
    from mlxcel.topology.names import DISAGG_ROLES

    cluster = dist.cluster
    required = cluster.pipeline_parallel_size >= 2 or not cluster.stages or dist.node.role in DISAGG_ROLES
    return load_secret(secret_file, toml_secret_file=cluster.secret_file, required=required)


def from_toml(path: str | Path, node_id: str, options: PipelineOptions = PipelineOptions()) -> Distributed:
    """The node ``node_id`` of a TOML that bring-up just wrote (its ranges are already planned)."""
    try:
        cluster = load_cluster_config(path).with_resume(options.max_resumes, options.resume_timeout_s)
        return Distributed(cluster, cluster.node(node_id), options)
    except ClusterConfigError as exc:
        raise CLIError(str(exc)) from None
