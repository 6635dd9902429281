"""``mlxcel serve`` / ``mlxcel-server``: the flags, parsed once into ``ServeFlags`` and checked once, then a
``ServeConfig`` and the role it names.

Order of checks (cheap first, each a one-line error): flag combinations (``ServeFlags.check``), the
environment, the checkpoint directory, the cluster TOML, the disaggregated roles' flags against it, the
role's own hook (``configure``: its settings), the cluster secret (loaded once per process, here), the
thread budget, access control, the listening socket; only then does the role (``mlxcel/entrypoints/``) start
and the model load (in the background, /health answering 503 until it is ready). Socket, exit and
uvicorn plumbing live in ``mlxcel/process.py``.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from mlxcel import envs
from mlxcel.config import DEFAULT_KV_GROUP_SIZE, DEFAULT_MLX_CACHE_MB
from mlxcel.entrypoints.flags import ServeFlags
from mlxcel.errors import CLIError
from mlxcel.entrypoints.context import RoleContext, ServeConfig
from mlxcel.topology.distributed import Distributed, PipelineOptions, load_distributed

if TYPE_CHECKING:
    from mlxcel.cluster.secret import ClusterSecret
    from mlxcel.server.runtime import ServerConfig

#: roles that need the cluster secret without a cluster TOML (fail closed); ``tp`` needs it with a hostfile
SECRET_ROLES = ("pp-auto", "pp-peer", "prefill", "decode", "router", "tp-rank")


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """The server's flags (shared by ``mlxcel serve`` and ``mlxcel-server``)."""
    ServeFlags.add_arguments(parser)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """``mlxcel serve``."""
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (same as mlxcel-server)")
    add_server_arguments(p)
    p.set_defaults(func=run)


def as_flags(args: argparse.Namespace | ServeFlags) -> ServeFlags:
    """The typed flags of a parsed namespace (the only place it is read)."""
    return args if isinstance(args, ServeFlags) else ServeFlags.from_cli_args(vars(args))


def check_cluster_flags(args: argparse.Namespace | ServeFlags) -> ServeFlags:
    """The cluster, pipeline and bring-up flags' combinations (part of ``ServeFlags.check``)."""
    flags = as_flags(args).resolve_peers()
    flags.check_cluster()
    return flags


def check_flags(args: argparse.Namespace | ServeFlags) -> ServeFlags:
    """Flag combinations of every feature and the environment (nothing is read or bound yet), once per start;
    returns the flags, checked, with ``--peers`` resolved."""
    from mlxcel.commands.windows import SERVER_FLAGS, check_native_windows

    flags = as_flags(args)
    check_native_windows(flags.values(), SERVER_FLAGS)  # first: native Windows runs no distributed mode
    flags = flags.check()
    envs.check()  # every MLXCEL_* variable, refused by name before any load
    return flags


def server_config(args: argparse.Namespace | ServeFlags) -> ServerConfig:
    """The checkpoint (checked) and the batching settings; raises CLIError/ModelError."""
    from mlxcel.models.loading import check_checkpoint
    from mlxcel.server.runtime import ServerConfig

    flags = as_flags(args).server
    model = Path(flags.model)
    check_checkpoint(model)
    name = flags.served_model_name if flags.served_model_name is not None else model.resolve().name
    if not name.strip():
        raise CLIError("--served-model-name must not be empty")
    return ServerConfig(model=model, served_model_name=name, parallel=flags.parallel,
                        max_batch_size=flags.max_batch_size or flags.parallel, max_queue=flags.max_queue,
                        request_timeout=flags.request_timeout, warmup=flags.warmup,
                        prefix_cache_mb=flags.prefix_cache_mb, kv_bits=flags.kv_bits,
                        kv_group_size=flags.kv_group_size or DEFAULT_KV_GROUP_SIZE)


def apply_threads(flags: ServeFlags) -> int:
    """Apply the thread budget (--threads, else $MLXCEL_THREADS) to the BLAS; returns the threads in effect."""
    from mlxcel.blas import apply_thread_budget

    try:
        return apply_thread_budget(flags.server.threads)
    except ValueError as exc:
        raise CLIError(str(exc)) from None


def pipeline_options(args: argparse.Namespace | ServeFlags) -> PipelineOptions:
    return as_flags(args).pipeline


def cluster_node(args: argparse.Namespace | ServeFlags, model: Path) -> Distributed | None:
    """--distributed-config: the TOML, the node, the stage ranges (the secret: ``process_secret``); else None."""
    flags = as_flags(args)
    cluster = flags.cluster
    if cluster.distributed_config is None:
        return None
    assert cluster.node_id is not None  # ServeFlags.check: they come together
    return load_distributed(cluster.distributed_config, cluster.node_id, model, options=flags.pipeline,
                            layers=cluster.pp_layers)


def process_secret(args: argparse.Namespace | ServeFlags, role: str, dist: Distributed | None) -> ClusterSecret | None:
    """The cluster secret, loaded once per process (``SecretError`` names every source): a cluster TOML node's
    (``cluster_secret``), else required by the roles that talk to peers, else None and nothing is read (tensor
    parallelism inside one process, a single node)."""
    from mlxcel.cluster.secret import load_secret
    from mlxcel.topology.distributed import cluster_secret

    flags = as_flags(args)
    path = flags.cluster.cluster_secret_file
    if dist is not None:
        return cluster_secret(dist, path)
    if role in SECRET_ROLES or (role == "tp" and flags.tp.tp_hostfile is not None):
        return load_secret(path, required=True)
    return None


def serve_config(args: argparse.Namespace | ServeFlags) -> ServeConfig:
    """Every check before anything listens, the chosen role's ``configure`` hook, the secret; the one config."""
    from mlxcel.entrypoints import select_role

    flags = check_flags(args)
    server = server_config(flags)
    dist = cluster_node(flags, server.model)
    if flags.disagg.wanted(dist):
        flags.disagg.check(dist, pp_auto=flags.bringup.pp_auto, pp_peer=flags.bringup.pp_peer)
    role = select_role(flags, dist)
    base = ServeConfig(role=role.name, server=server, log_level=flags.server.log_level,
                       drain_timeout_s=flags.server.drain_timeout, pipeline=flags.pipeline, dist=dist)
    config = role.configure(flags, base)
    config = replace(config, secret=process_secret(flags, role.name, dist))
    apply_cache_limit(flags)
    return replace(config, threads=apply_threads(flags))


def apply_cache_limit(flags: ServeFlags) -> int:
    """Bound MLX's cache of freed buffers (``mx.set_cache_limit``): --mlx-cache-mb, else the default or MLX's
    own bound, whichever is lower; returns the bound in bytes."""
    import mlx.core as mx

    chosen = flags.server.mlx_cache_mb
    if chosen is not None:
        limit = chosen << 20
    else:
        own = mx.set_cache_limit(0)
        limit = min(DEFAULT_MLX_CACHE_MB << 20, own)
    mx.set_cache_limit(limit)
    return limit


def run(args: argparse.Namespace) -> int:
    """Configure, bind, run the role; returns only for preflight errors (raised), else exits the process."""
    from mlxcel.blas import blas_in_use
    from mlxcel.commands.standby import wait_if_standby
    from mlxcel.process import Endpoint, bind_socket, exit_process
    from mlxcel.entrypoints import ROLES
    from mlxcel.server.access import prepare_access

    wait_if_standby()  # a supervisor's warm standby waits here until it is to become the node
    flags = as_flags(args)
    logging.basicConfig(level=flags.server.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = serve_config(flags)
    role = ROLES[config.role]
    # keys, TLS files and the fail-closed bind policy, before anything listens
    access = prepare_access(flags.access, flags.server.host, health_only=not role.serves_api)
    sock = bind_socket(flags.server.host, flags.server.port)
    # after every preflight check, so that a refusal stays one line on stderr
    logging.getLogger("mlxcel.server").info("BLAS %s: %d thread(s) per matrix product", blas_in_use(), config.threads)
    endpoint = Endpoint(sock, scheme=access.scheme, log_level=config.log_level,
                        drain_timeout_s=config.drain_timeout_s, uvicorn_options=access.uvicorn_options())
    exit_process(role.run(RoleContext(config, access, endpoint)))

