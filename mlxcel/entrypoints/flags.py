"""``ServeFlags``: the server's flags, one frozen dataclass per feature, parsed once and checked once.

``ServeFlags.add_arguments`` adds every group to a parser (``mlxcel serve`` and ``mlxcel-server``);
``from_cli_args`` builds the sections from the parsed values (``vars(namespace)``, in
``mlxcel/commands/serve.py``, the only place that reads the namespace); ``check`` refuses bad flag
combinations once per start, before anything is read or bound, and returns the flags with ``--peers``
resolved into the role's own list. A role's ``configure`` hook reads its section. Sections: ``ServerFlags`` (the HTTP server and its
batching), ``ClusterFlags`` (a cluster TOML's pipeline), ``ResumeFlags``, ``BringupFlags``
(``mlxcel/bringup/flags.py``), ``DisaggFlags`` (``mlxcel/disagg/flags.py``; checked once the cluster
TOML is read), ``TPFlags`` (``mlxcel/parallel/options.py``) and ``AccessFlags`` (``mlxcel/server/access.py``).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields, replace
from typing import Any, Mapping

from mlxcel.bringup.flags import BringupFlags
from mlxcel.config import (
    DEFAULT_DRAIN_TIMEOUT_S,
    DEFAULT_HOST,
    DEFAULT_MAX_QUEUE,
    DEFAULT_MAX_RESUMES,
    DEFAULT_MLX_CACHE_MB,
    DEFAULT_MODEL_DIR,
    DEFAULT_PARALLEL,
    DEFAULT_PORT,
    DEFAULT_PREFIX_CACHE_MB,
    DEFAULT_KV_GROUP_SIZE,
    KV_BITS,
    KV_GROUP_SIZES,
    DEFAULT_RESUME_TIMEOUT_S,
    MAX_PP_MICRO_BATCH_SIZE,
    MAX_RESUME_TIMEOUT_S,
    MAX_RESUMES,
    THREADS_ENV,
    check_micro_batch_size,
    non_negative_int,
    positive_int,
    resume_count,
    resume_seconds,
    seconds,
    thread_count,
)
from mlxcel.config import port as tcp_port
from mlxcel.disagg.flags import DisaggFlags
from mlxcel.errors import CLIError
from mlxcel.flagset import FlagSet
from mlxcel.parallel.options import TPFlags
from mlxcel.server.access import AccessFlags
from mlxcel.topology.distributed import PipelineOptions

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """The HTTP server's and its batching's flags (the first, ungrouped part of ``--help``)."""
    parser.add_argument("-m", "--model", default=DEFAULT_MODEL_DIR,
                        help=f"checkpoint directory (default {DEFAULT_MODEL_DIR})")
    parser.add_argument("--host", default=DEFAULT_HOST, help=f"address to listen on (default {DEFAULT_HOST})")
    parser.add_argument("--port", type=tcp_port, default=DEFAULT_PORT,
                        help=f"TCP port (default {DEFAULT_PORT}; 0 = any free port)")
    parser.add_argument("--parallel", type=positive_int, default=DEFAULT_PARALLEL,
                        help=f"concurrent sequences with a KV cache (default {DEFAULT_PARALLEL})")
    parser.add_argument("--max-batch-size", type=positive_int, default=None,
                        help="sequences per decode step, at most --parallel (default: --parallel)")
    parser.add_argument("--max-queue", type=non_negative_int, default=DEFAULT_MAX_QUEUE,
                        help=f"requests waiting beyond --parallel before 503 (default {DEFAULT_MAX_QUEUE})")
    parser.add_argument("--request-timeout", type=seconds, default=None,
                        help="seconds a request may take, queueing included (default: no limit)")
    parser.add_argument("--drain-timeout", type=seconds, default=DEFAULT_DRAIN_TIMEOUT_S,
                        help=("on SIGINT/SIGTERM: seconds that requests in flight may take to finish while new "
                              f"connections are refused (default {DEFAULT_DRAIN_TIMEOUT_S:g})"))
    parser.add_argument("--prefix-cache-mb", type=non_negative_int, default=DEFAULT_PREFIX_CACHE_MB,
                        help=("MiB of KV cache kept to reuse shared prompt prefixes "
                              f"(default {DEFAULT_PREFIX_CACHE_MB}; 0 = off)"))
    add_kv_arguments(parser)
    parser.add_argument("--threads", type=thread_count, default=None, metavar="N",
                        help=f"threads one matrix product may use; nodes sharing a host split its cores "
                             f"(default: ${THREADS_ENV}, else every core but one, at least one)")
    parser.add_argument("--mlx-cache-mb", type=non_negative_int, default=None, metavar="MIB",
                        help=f"MiB of freed device buffers MLX keeps for reuse (default {DEFAULT_MLX_CACHE_MB}, or "
                             "MLX's own bound where lower; 0 = keep none)")
    parser.add_argument("--no-warmup", dest="warmup", action="store_false",
                        help="report ready right after loading, without a warmup generation")
    parser.add_argument("--served-model-name", default=None,
                        help="model id clients send and /v1/models lists (default: the directory name)")
    parser.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="log verbosity (default info)")


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    """The "pipeline cluster" group: a cluster TOML's node and its pipeline."""
    group = parser.add_argument_group("pipeline cluster")
    group.add_argument("--distributed-config", default=None, metavar="FILE",
                       help="cluster TOML: nodes, roles, addresses, stage layers (needs --node-id)")
    group.add_argument("--node-id", default=None, metavar="ID", help="this process's node in --distributed-config")
    group.add_argument("--cluster-secret-file", default=None, metavar="PATH",
                       help="file holding the cluster secret (else MLXCEL_CLUSTER_SECRET_FILE, "
                            "MLXCEL_CLUSTER_SECRET, [cluster] secret_file)")
    group.add_argument("--pp-layers", default=None, metavar="RANGES",
                       help="inclusive layer ranges of the pipeline's stages, e.g. 0-15,16-31 (with "
                            "--distributed-config: one per stage of the TOML, which they set where it gives no "
                            "layers and must equal where it does; default: the TOML's, else split by parameter bytes)")
    group.add_argument("--peers", default=None, metavar="A:P,...",
                       help="the peer list of the role started: --cluster-peers of a --pp-auto coordinator, "
                            "--decode-peers of a --node-role prefill node (refused elsewhere)")
    group.add_argument("--pp-micro-batch-size", type=int, default=None, metavar="M",
                       help=f"rows per pipeline micro-batch (1 to {MAX_PP_MICRO_BATCH_SIZE}; default: the TOML's, "
                            "else ceil(batch / stages))")
    group.add_argument("--pp-return-logits", action="store_true",
                       help="coordinator: the last stage returns full logits and the coordinator samples "
                            "(default: the last stage samples and returns token ids, a few bytes per token)")
    group.add_argument("--pp-stop-stages", action="store_true",
                       help="coordinator: when it stops (after draining), send SHUTDOWN to every stage, which "
                            "exits 0 (default: the stages keep running for the next coordinator)")


def add_resume_arguments(parser: argparse.ArgumentParser) -> None:
    """Resuming requests whose node failed (the coordinator and the router; docs/pipeline.md §5.6)."""
    group = parser.add_argument_group("resuming requests after a node failure (coordinator, router)")
    group.add_argument("--max-resumes", type=resume_count, default=None, metavar="N",
                       help=f"resume a request in flight at most N times after a stage, prefill or decode node "
                            f"died, froze or restarted: its prompt and the tokens streamed are prefilled again and "
                            f"the stream goes on (0 to {MAX_RESUMES}; 0 fails it with 503 as before; default "
                            f"{DEFAULT_MAX_RESUMES}, or the TOML's max_resumes)")
    group.add_argument("--resume-timeout", type=resume_seconds, default=None, metavar="S",
                       help=f"how long one resume waits for a node to take the request before it fails with 503 "
                            f"(at most {MAX_RESUME_TIMEOUT_S:g}; default {DEFAULT_RESUME_TIMEOUT_S:g}, or the TOML's "
                            "resume_s)")


def add_kv_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """--kv-bits and --kv-group-size (every role that holds KV; ``mlxcel generate`` too)."""
    parser.add_argument("--kv-bits", type=int, choices=KV_BITS, default=None,
                        help="quantize the KV cache to this many bits from the first token (default: full "
                             "precision; families whose every layer keeps a KVCache; docs/models.md)")
    parser.add_argument("--kv-group-size", type=int, choices=KV_GROUP_SIZES, default=None,
                        help=f"values per quantization scale and bias of --kv-bits (default {DEFAULT_KV_GROUP_SIZE})")


def check_kv_flags(kv_bits: int | None, kv_group_size: int | None) -> None:
    """--kv-group-size needs --kv-bits."""
    if kv_group_size is not None and kv_bits is None:
        raise CLIError("--kv-group-size needs --kv-bits (it sizes the KV cache's quantization groups)")


@dataclass(frozen=True)
class ServerFlags(FlagSet):
    """The HTTP server and its batching."""

    model: str = DEFAULT_MODEL_DIR
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    parallel: int = DEFAULT_PARALLEL
    max_batch_size: int | None = None
    max_queue: int = DEFAULT_MAX_QUEUE
    request_timeout: float | None = None
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT_S
    prefix_cache_mb: int = DEFAULT_PREFIX_CACHE_MB
    kv_bits: int | None = None
    kv_group_size: int | None = None
    threads: int | None = None
    mlx_cache_mb: int | None = None
    warmup: bool = True
    served_model_name: str | None = None
    log_level: str = "info"

    add_arguments = staticmethod(add_server_arguments)

    def check(self) -> None:
        check_kv_flags(self.kv_bits, self.kv_group_size)
        if (self.max_batch_size or self.parallel) > self.parallel:
            raise CLIError(f"--max-batch-size ({self.max_batch_size}) cannot exceed --parallel ({self.parallel}): "
                           "a decode step batches only sequences that hold a slot")


@dataclass(frozen=True)
class ClusterFlags(FlagSet):
    """A cluster TOML's node (``--distributed-config``, ``--node-id``), the secret's file, the pipeline's flags."""

    distributed_config: str | None = None
    node_id: str | None = None
    cluster_secret_file: str | None = None
    pp_layers: str | None = None
    peers: str | None = None
    pp_micro_batch_size: int | None = None
    pp_return_logits: bool = False
    pp_stop_stages: bool = False

    add_arguments = staticmethod(add_cluster_arguments)


@dataclass(frozen=True)
class ResumeFlags(FlagSet):
    """--max-resumes and --resume-timeout (None: the default, or the cluster TOML's)."""

    max_resumes: int | None = None
    resume_timeout: float | None = None

    add_arguments = staticmethod(add_resume_arguments)


@dataclass(frozen=True)
class ServeFlags:
    """Every flag of ``mlxcel serve`` / ``mlxcel-server``, by feature."""

    server: ServerFlags = ServerFlags()
    cluster: ClusterFlags = ClusterFlags()
    resume: ResumeFlags = ResumeFlags()
    bringup: BringupFlags = BringupFlags()
    disagg: DisaggFlags = DisaggFlags()
    tp: TPFlags = TPFlags()
    access: AccessFlags = AccessFlags()

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        """Every group, in ``--help``'s order."""
        ServerFlags.add_arguments(parser)
        ClusterFlags.add_arguments(parser)
        ResumeFlags.add_arguments(parser)
        BringupFlags.add_arguments(parser)
        DisaggFlags.add_arguments(parser.add_argument_group("disaggregated inference (docs/disagg.md)"))
        TPFlags.add_arguments(parser, server=True)
        AccessFlags.add_arguments(parser)

    @classmethod
    def from_cli_args(cls, parsed: Mapping[str, Any]) -> ServeFlags:
        """Every section from the parsed values (``vars(namespace)``)."""
        return cls(**{name: kind.from_cli_args(parsed) for name, kind in SECTIONS.items()})

    def values(self) -> dict[str, Any]:
        """Every flag by its argparse ``dest`` (what ``mlxcel/commands/windows.py`` checks)."""
        return {f.name: getattr(section, f.name) for section in self._sections() for f in fields(section)}

    def _sections(self) -> list[Any]:
        return [getattr(self, f.name) for f in fields(self)]

    @property
    def pipeline(self) -> PipelineOptions:
        """The coordinator's pipeline options (the TOML's where a flag is not given)."""
        return PipelineOptions(self.cluster.pp_micro_batch_size, self.cluster.pp_return_logits,
                               self.cluster.pp_stop_stages, self.resume.max_resumes, self.resume.resume_timeout)

    def check(self) -> ServeFlags:
        """Flag combinations of every feature but the disaggregated roles' (``DisaggFlags.check``, once the cluster
        TOML is read); nothing is read or bound. Returns the flags with ``--peers`` resolved."""
        flags = self.resolve_peers()
        flags.check_cluster()
        flags.tp.check(distributed_config=flags.cluster.distributed_config, pp_auto=flags.bringup.pp_auto,
                       pp_layers=flags.cluster.pp_layers, node_role=flags.disagg.node_role,
                       pp_peer=flags.bringup.pp_peer)
        flags.server.check()
        return flags

    def resolve_peers(self) -> ServeFlags:
        """--peers: the peer list of the role started, as that role's own flag (``--cluster-peers`` of a --pp-auto
        coordinator, ``--decode-peers`` of a prefill node); refused where it would be ambiguous or unused."""
        peers = self.cluster.peers
        if peers is None:
            return self
        if self.disagg.node_role == "router":
            raise CLIError("--peers is ambiguous for --node-role router: give --prefill-peers and --decode-peers")
        if self.bringup.pp_auto is not None:
            section, target = "bringup", "cluster_peers"
        elif self.disagg.node_role == "prefill":
            section, target = "disagg", "decode_peers"
        else:
            raise CLIError("--peers needs --pp-auto (its --cluster-peers) or --node-role prefill (its --decode-peers)")
        if getattr(getattr(self, section), target) is not None:
            raise CLIError(f"--peers and --{target.replace('_', '-')} name the same list; give one of them")
        resolved = replace(getattr(self, section), **{target: peers})
        return replace(self, cluster=replace(self.cluster, peers=None), **{section: resolved})

    def check_cluster(self) -> None:
        """--distributed-config and --node-id come together; pipeline-only flags need them."""
        cluster, bringup = self.cluster, self.bringup
        # --pp-auto / --pp-peer exclusions first: --dry-run with --pp-peer binds nothing
        bringup.check(distributed_config=cluster.distributed_config, resume_timeout=self.resume.resume_timeout,
                      host=self.server.host)
        self._check_pp_layers()
        if cluster.node_id is not None and cluster.distributed_config is None:
            raise CLIError("--node-id needs --distributed-config (the cluster TOML that defines the node)")
        if cluster.distributed_config is not None and cluster.node_id is None:
            raise CLIError("--distributed-config needs --node-id (which node of the cluster this process is)")
        if cluster.node_id is not None and not cluster.node_id.strip():
            raise CLIError("--node-id must not be empty")
        pipeline = cluster.distributed_config is not None or bringup.pp_auto is not None
        if cluster.pp_micro_batch_size is not None and not pipeline:
            raise CLIError("--pp-micro-batch-size needs --distributed-config or --pp-auto (it sizes a pipeline's "
                           "micro-batches)")
        if cluster.pp_micro_batch_size is not None:
            try:
                check_micro_batch_size(cluster.pp_micro_batch_size)  # generate's bound and texts (mlxcel.config)
            except ValueError as exc:
                raise CLIError(str(exc)) from None
        if cluster.pp_stop_stages and not pipeline:
            raise CLIError("--pp-stop-stages needs --distributed-config or --pp-auto (it stops a pipeline's stages)")

    def _check_pp_layers(self) -> None:
        """--pp-layers: the generate's grammar and texts; it sets the stages of a --distributed-config pipeline
        only (its count and the model's layers are checked once the TOML and config.json are read)."""
        from mlxcel.topology.partition import PartitionError, parse_range_text

        text = self.cluster.pp_layers
        if text is None:
            return
        try:
            parse_range_text(text)
        except PartitionError as exc:
            raise CLIError(str(exc)) from None
        if self.bringup.pp_auto is not None:
            raise CLIError("--pp-layers cannot be combined with --pp-auto: each --pp-peer derives its stage's layers "
                           "from its own checkpoint and refuses any other range (docs/bringup.md); for explicit "
                           "ranges use --distributed-config")
        if self.cluster.distributed_config is None and self.bringup.pp_peer:
            raise CLIError("--pp-layers cannot be combined with --pp-peer: the coordinator assigns a peer its layers")
        if self.cluster.distributed_config is None:
            raise CLIError("--pp-layers needs --distributed-config (it sets the stage layer ranges of its pipeline)")


#: the sections of ``ServeFlags``, by field
SECTIONS: dict[str, type[FlagSet]] = {"server": ServerFlags, "cluster": ClusterFlags, "resume": ResumeFlags,
                                      "bringup": BringupFlags, "disagg": DisaggFlags, "tp": TPFlags,
                                      "access": AccessFlags}
