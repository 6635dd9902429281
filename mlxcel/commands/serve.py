"""``mlxcel serve`` / ``mlxcel-server``: the flags, parsed once into a ``ServeConfig``, then the role it names.

Order of checks (cheap first, each a one-line error): flag combinations, the checkpoint directory,
the cluster TOML with its secret, the role's own hook (``configure``: its settings and secret), the
thread budget, access control, the listening socket; only then does the role
(``mlxcel/roles/``) start and the model load (in the background, /health answering 503 until it
is ready). Socket, exit and uvicorn plumbing live in ``mlxcel/process.py``.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from mlxcel.config import (
    DEFAULT_DRAIN_TIMEOUT_S,
    DEFAULT_HOST,
    DEFAULT_MAX_QUEUE,
    DEFAULT_MODEL_DIR,
    DEFAULT_PARALLEL,
    DEFAULT_PORT,
    DEFAULT_MLX_CACHE_MB,
    DEFAULT_PREFIX_CACHE_MB,
    DEFAULT_MAX_RESUMES,
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
    udp_port,
)
from mlxcel import envs
from mlxcel.bringup import wire
from mlxcel.bringup.flags import check_bringup_flags, spare_count, spare_seconds
from mlxcel.config import port as tcp_port
from mlxcel.disagg.flags import add_disagg_arguments
from mlxcel.errors import CLIError
from mlxcel.parallel.options import add_tp_arguments
from mlxcel.server.access import add_access_arguments
from mlxcel.roles.context import RoleContext, ServeConfig
from mlxcel.topology.distributed import Distributed, PipelineOptions, load_distributed

if TYPE_CHECKING:
    from mlxcel.server.runtime import ServerConfig

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """The server's flags (shared by ``mlxcel serve`` and ``mlxcel-server``)."""
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
    _add_cluster_arguments(parser)
    _add_resume_arguments(parser)
    _add_bringup_arguments(parser)
    add_disagg_arguments(parser.add_argument_group("disaggregated inference (docs/disagg.md)"))
    add_tp_arguments(parser, server=True)
    add_access_arguments(parser)


def _add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
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


def _add_resume_arguments(parser: argparse.ArgumentParser) -> None:
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


def _add_bringup_arguments(parser: argparse.ArgumentParser) -> None:
    """Zero-config bring-up (docs/bringup.md); checked by ``mlxcel.bringup.flags``."""
    group = parser.add_argument_group("zero-config bring-up (docs/bringup.md)")
    group.add_argument("--pp-auto", type=positive_int, default=None, metavar="N",
                       help="coordinator of an N-stage pipeline: find N --pp-peer processes, plan the cluster, "
                            "assign their stages and serve the API (runs no stage itself)")
    group.add_argument("--pp-peer", action="store_true",
                       help="wait for a stage assignment from a --pp-auto coordinator, then serve that stage")
    group.add_argument("--cluster-name", default=None, metavar="NAME",
                       help=f"the cluster's name; peers refuse another (default {wire.DEFAULT_CLUSTER_NAME})")
    group.add_argument("--cluster-peers", default=None, metavar="A:P,...",
                       help="--pp-auto, static discovery: the peers' --cluster-control-addr addresses")
    group.add_argument("--cluster-control-addr", default=None, metavar="IP:PORT",
                       help="coordinator: its cluster address (default: the --host IP, port "
                            f"{wire.DEFAULT_CONTROL_PORT}); peer: its listener for the assignment and then its "
                            "stage (default with mdns: 0.0.0.0 and an OS-assigned port)")
    group.add_argument("--cluster-discovery", choices=wire.DISCOVERY_MODES, default=None,
                       help=f"static (--cluster-peers) or mdns (signed UDP beacons) (default {wire.DEFAULT_DISCOVERY})")
    group.add_argument("--cluster-discovery-target", default=None, metavar="IP",
                       help=f"peer, mdns: where beacons go (default {wire.DEFAULT_DISCOVERY_TARGET}; a directed "
                            "broadcast or the coordinator's IP)")
    group.add_argument("--cluster-discovery-port", type=udp_port, default=None, metavar="PORT",
                       help=f"mdns: the beacons' UDP port (1-65535; default {wire.DEFAULT_DISCOVERY_PORT})")
    group.add_argument("--cluster-config-out", default=None, metavar="PATH",
                       help=f"where the cluster TOML is written (coordinator default {wire.DEFAULT_COORDINATOR_CONFIG_OUT}, "
                            f"peer default {wire.DEFAULT_PEER_CONFIG_OUT}; {{node_id}} becomes the assigned node id)")
    group.add_argument("--dry-run", action="store_true",
                       help="--pp-auto only: plan the cluster, write --cluster-config-out and exit")
    group.add_argument("--pp-spare", type=spare_count, default=None, metavar="K",
                       help=f"--pp-auto only: K more --pp-peer processes wait as standbys; a stage down longer than "
                            f"--pp-spare-after is assigned to one of them (0 to {wire.MAX_SPARES}; default "
                            f"{wire.DEFAULT_SPARES}; static discovery lists N+K peers)")
    group.add_argument("--pp-spare-after", type=spare_seconds, default=None, metavar="S",
                       help=f"--pp-auto with --pp-spare: how long a stage stays down before its layers go to a spare "
                            f"(> 0 to {wire.MAX_SPARE_AFTER_S:g} seconds and below --resume-timeout; default "
                            f"{wire.DEFAULT_SPARE_AFTER_S:g})")


def check_cluster_flags(args: argparse.Namespace) -> None:
    """--distributed-config and --node-id come together; pipeline-only flags need them."""
    resolve_peers(args)
    check_bringup_flags(args)  # --pp-auto / --pp-peer exclusions first: --dry-run with --pp-peer binds nothing
    check_pp_layers(args)
    if args.node_id is not None and args.distributed_config is None:
        raise CLIError("--node-id needs --distributed-config (the cluster TOML that defines the node)")
    if args.distributed_config is not None and args.node_id is None:
        raise CLIError("--distributed-config needs --node-id (which node of the cluster this process is)")
    if args.node_id is not None and not args.node_id.strip():
        raise CLIError("--node-id must not be empty")
    pipeline = args.distributed_config is not None or args.pp_auto is not None
    if args.pp_micro_batch_size is not None and not pipeline:
        raise CLIError("--pp-micro-batch-size needs --distributed-config or --pp-auto (it sizes a pipeline's micro-batches)")
    if args.pp_micro_batch_size is not None:
        try:
            check_micro_batch_size(args.pp_micro_batch_size)  # generate's bound and texts (mlxcel.config)
        except ValueError as exc:
            raise CLIError(str(exc)) from None
    if args.pp_stop_stages and not pipeline:
        raise CLIError("--pp-stop-stages needs --distributed-config or --pp-auto (it stops a pipeline's stages)")


def check_pp_layers(args: argparse.Namespace) -> None:
    """--pp-layers: the generate's grammar and texts; it sets the stages of a --distributed-config pipeline only
    (its count and the model's layers are checked once the TOML and config.json are read: ``load_distributed``)."""
    from mlxcel.topology.partition import PartitionError, parse_range_text

    text = getattr(args, "pp_layers", None)
    if text is None:
        return
    try:
        parse_range_text(text)
    except PartitionError as exc:
        raise CLIError(str(exc)) from None
    if args.pp_auto is not None:
        raise CLIError("--pp-layers cannot be combined with --pp-auto: each --pp-peer derives its stage's layers from "
                       "its own checkpoint and refuses any other range (docs/bringup.md); for explicit ranges use "
                       "--distributed-config")
    if args.distributed_config is None and args.pp_peer:
        raise CLIError("--pp-layers cannot be combined with --pp-peer: the coordinator assigns a peer its layers")
    if args.distributed_config is None:
        raise CLIError("--pp-layers needs --distributed-config (it sets the stage layer ranges of its pipeline)")


def resolve_peers(args: argparse.Namespace) -> None:
    """--peers: the peer list of the role started, stored as that role's own flag (``--cluster-peers`` of a
    --pp-auto coordinator, ``--decode-peers`` of a prefill node); refused where it would be ambiguous or unused."""
    peers = getattr(args, "peers", None)
    if peers is None:
        return
    if getattr(args, "node_role", None) == "router":
        raise CLIError("--peers is ambiguous for --node-role router: give --prefill-peers and --decode-peers")
    if args.pp_auto is not None:
        target = "cluster_peers"
    elif getattr(args, "node_role", None) == "prefill":
        target = "decode_peers"
    else:
        raise CLIError("--peers needs --pp-auto (its --cluster-peers) or --node-role prefill (its --decode-peers)")
    if getattr(args, target, None) is not None:
        raise CLIError(f"--peers and --{target.replace('_', '-')} name the same list; give one of them")
    setattr(args, target, peers)
    args.peers = None  # resolved: the checks of the target flag apply, and a second call is a no-op


def check_flags(args: argparse.Namespace) -> None:
    """Flag combinations of every feature (nothing is read or bound yet)."""
    from mlxcel.parallel.options import check_tp_flags
    from mlxcel.commands.windows import SERVER_FLAGS, check_native_windows

    check_native_windows(args, SERVER_FLAGS)  # first: native Windows runs no distributed mode
    check_cluster_flags(args)
    check_tp_flags(args)
    envs.check()  # every MLXCEL_* variable, refused by name before any load
    if (args.max_batch_size or args.parallel) > args.parallel:
        raise CLIError(f"--max-batch-size ({args.max_batch_size}) cannot exceed --parallel ({args.parallel}): "
                       "a decode step batches only sequences that hold a slot")


def server_config(args: argparse.Namespace) -> ServerConfig:
    """The checkpoint (checked) and the batching settings; raises CLIError/ModelError."""
    from mlxcel.models.loading import check_checkpoint
    from mlxcel.server.runtime import ServerConfig

    model = Path(args.model)
    check_checkpoint(model)
    name = args.served_model_name if args.served_model_name is not None else model.resolve().name
    if not name.strip():
        raise CLIError("--served-model-name must not be empty")
    return ServerConfig(model=model, served_model_name=name, parallel=args.parallel,
                        max_batch_size=args.max_batch_size or args.parallel, max_queue=args.max_queue,
                        request_timeout=args.request_timeout, warmup=args.warmup, prefix_cache_mb=args.prefix_cache_mb)


def apply_threads(args: argparse.Namespace) -> int:
    """Apply the thread budget (--threads, else $MLXCEL_THREADS) to the BLAS; returns the threads in effect."""
    from mlxcel.blas import apply_thread_budget

    try:
        return apply_thread_budget(args.threads)
    except ValueError as exc:
        raise CLIError(str(exc)) from None


def pipeline_options(args: argparse.Namespace) -> PipelineOptions:
    return PipelineOptions(getattr(args, "pp_micro_batch_size", None), getattr(args, "pp_return_logits", False),
                           getattr(args, "pp_stop_stages", False), getattr(args, "max_resumes", None),
                           getattr(args, "resume_timeout", None))


def cluster_node(args: argparse.Namespace, model: Path) -> Distributed | None:
    """--distributed-config: the TOML, the node, the secret (fail closed), the stage ranges; else None."""
    if args.distributed_config is None:
        return None
    return load_distributed(args.distributed_config, args.node_id, model,
                            secret_file=getattr(args, "cluster_secret_file", None), options=pipeline_options(args),
                            layers=getattr(args, "pp_layers", None))


def serve_config(args: argparse.Namespace) -> ServeConfig:
    """Every check before anything listens, then the chosen role's ``configure`` hook; the one config."""
    from mlxcel.disagg.flags import check_disagg_flags, wants_disagg
    from mlxcel.roles import select_role

    check_flags(args)
    server = server_config(args)
    dist = cluster_node(args, server.model)
    if wants_disagg(args, dist):
        check_disagg_flags(args, dist)
    role = select_role(args, dist)
    base = ServeConfig(role=role.name, server=server, log_level=args.log_level, drain_timeout_s=args.drain_timeout,
                       pipeline=pipeline_options(args), dist=dist, secret=dist.secret if dist else None)
    config = role.configure(args, base)
    apply_cache_limit(args)
    return replace(config, threads=apply_threads(args))


def apply_cache_limit(args: argparse.Namespace) -> int:
    """Bound MLX's cache of freed buffers (``mx.set_cache_limit``): --mlx-cache-mb, else the default or MLX's
    own bound, whichever is lower; returns the bound in bytes."""
    import mlx.core as mx

    chosen = getattr(args, "mlx_cache_mb", None)
    if chosen is not None:
        limit = chosen << 20
    else:
        own = mx.set_cache_limit(0)
        limit = min(DEFAULT_MLX_CACHE_MB << 20, own)
    mx.set_cache_limit(limit)
    return limit


def run_server(args: argparse.Namespace) -> int:
    """Configure, bind, run the role; returns only for preflight errors (raised), else exits the process."""
    from mlxcel.blas import blas_in_use
    from mlxcel.commands.standby import wait_if_standby
    from mlxcel.process import Endpoint, bind_socket, exit_process
    from mlxcel.roles import ROLES
    from mlxcel.server.access import prepare_access

    wait_if_standby()  # a supervisor's warm standby waits here until it is to become the node
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = serve_config(args)
    role = ROLES[config.role]
    # keys, TLS files and the fail-closed bind policy, before anything listens
    access = prepare_access(args, health_only=not role.serves_api)
    sock = bind_socket(args.host, args.port)
    # after every preflight check, so that a refusal stays one line on stderr
    logging.getLogger("mlxcel.server").info("BLAS %s: %d thread(s) per matrix product", blas_in_use(), config.threads)
    endpoint = Endpoint(sock, scheme=access.scheme, log_level=config.log_level,
                        drain_timeout_s=config.drain_timeout_s, uvicorn_options=access.uvicorn_options())
    exit_process(role.run(RoleContext(config, access, endpoint)))
