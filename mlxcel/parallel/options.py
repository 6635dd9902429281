"""``--tp-*`` flags: definitions and every check that needs no weights (defaults and bounds: ``mlxcel.config``).

``add_tp_arguments`` adds the group to ``mlxcel generate`` and to the server; ``prepare_tp`` checks
flag combinations, the hostfile and the shard plan (config.json only) and returns ``TPOptions``, or
None when tensor parallelism is off. Imports no MLX (the backend check imports it only when asked).
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from mlxcel.config import (
    DEFAULT_TP_HOSTFILE_PORT,
    DEFAULT_TP_MOE_MODE,
    DEFAULT_TP_REDUCE_DTYPE,
    DEFAULT_TP_SIZE,
    DEFAULT_TP_TIMEOUT_S,
    DEFAULT_TP_VOCAB_MODE,
    TP_BACKENDS,
    TP_MOE_MODES,
    TP_REDUCE_DTYPES,
    TP_VOCAB_MODES,
    non_negative_int,
    positive_int,
    seconds,
)
from mlxcel.parallel.errors import TPError
from mlxcel.parallel.hostfile import PLAINTEXT_FLAG, Hostfile, load_hostfile
from mlxcel.parallel.plan import FAMILIES, FAMILIES_HELP, ShardPlan, check_shardable

log = logging.getLogger("mlxcel.parallel")

PLAINTEXT_WARNING = ("--tp-allow-plaintext-network: tensors between tensor-parallel ranks cross the network as "
                     "plain, unauthenticated TCP (MLX's collectives); anyone on that network can read every "
                     "activation and forge or corrupt them. Use it only on a link you trust end to end.")


@dataclass(frozen=True)
class TPOptions:
    """Checked tensor-parallel settings of this process."""

    size: int
    plan: ShardPlan
    backend: str = "auto"  # resolved by ``launch.resolve_backend`` when the group starts
    rank: int = 0
    hostfile: Hostfile | None = None
    port: int | None = None  # first ring port; None: free loopback ports (local ranks only)
    allow_plaintext: bool = False
    timeout: float = DEFAULT_TP_TIMEOUT_S
    reduce_dtype: str = DEFAULT_TP_REDUCE_DTYPE  # rank 0's value is every rank's (sent in the hello reply)

    @property
    def local(self) -> bool:
        """Rank 0 starts the other ranks itself (no hostfile)."""
        return self.hostfile is None


def ring_port(text: str) -> int:
    """argparse type: a first ring port, 1 to 65535 (each rank takes the next one)."""
    value = positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port (1-65535), got {value}")
    return value


def add_tp_arguments(parser: argparse.ArgumentParser, *, server: bool) -> None:
    """The "tensor parallelism" flag group (docs/tp.md)."""
    group = parser.add_argument_group("tensor parallelism (docs/tp.md)")
    group.add_argument("--tp-size", type=positive_int, default=DEFAULT_TP_SIZE, metavar="N",
                       help=f"shard every layer over N ranks (default {DEFAULT_TP_SIZE} = off); N must divide the "
                            f"attention heads, KV heads, intermediate size (and the experts or their width, see "
                            f"--tp-moe-mode). Families: {FAMILIES_HELP}")
    group.add_argument("--tp-backend", choices=TP_BACKENDS, default="auto",
                       help="MLX distributed backend: ring (TCP, CPU hosts), nccl (NVIDIA), jaccl (Thunderbolt "
                            "Macs); auto = the hostfile's backend, else nccl on CUDA, else ring (default auto)")
    group.add_argument("--tp-hostfile", default=None, metavar="FILE",
                       help="multi-host: mlx.launch's JSON hostfile, host i = rank i; each host runs its own rank "
                            "with --tp-rank (default: rank 0 starts all ranks on this host, over loopback)")
    group.add_argument("--tp-rank", type=non_negative_int, default=None, metavar="R",
                       help="with --tp-hostfile: this process's rank (0 serves" + (" the API" if server else "")
                            + "; the others follow it)")
    group.add_argument("--tp-port", type=ring_port, default=None, metavar="P",
                       help="first ring port: rank r listens on P+r, rank 0's control channel after the last ring "
                            f"port (default: free loopback ports; {DEFAULT_TP_HOSTFILE_PORT} with --tp-hostfile)")
    group.add_argument(PLAINTEXT_FLAG, dest="tp_allow_plaintext_network", action="store_true",
                       help="accept a --tp-hostfile with non-loopback addresses: MLX's collectives are plain, "
                            "unauthenticated TCP (logs a warning; see docs/tp.md)")
    group.add_argument("--tp-embedding-mode", choices=TP_VOCAB_MODES, default=DEFAULT_TP_VOCAB_MODE,
                       help="embedding table: replicated on every rank (default; vocab_parallel is refused)")
    group.add_argument("--tp-lm-head-mode", choices=TP_VOCAB_MODES, default=DEFAULT_TP_VOCAB_MODE,
                       help="LM head: replicated on every rank (default; vocab_parallel is refused)")
    group.add_argument("--tp-moe-mode", choices=TP_MOE_MODES, default=None,
                       help="routed experts of a mixture-of-experts checkpoint: expert_parallel = E/N whole experts "
                            "per rank (N must divide the experts), within_expert = every expert on every rank, 1/N "
                            f"of its width each (N must divide the expert width); default {DEFAULT_TP_MOE_MODE}. "
                            "Refused for a checkpoint without experts")
    group.add_argument("--tp-reduce-dtype", choices=TP_REDUCE_DTYPES, default=DEFAULT_TP_REDUCE_DTYPE,
                       help="dtype of the partial sums each all-reduce carries: model = the model's own (default), "
                            "bfloat16 halves a float32 model's bytes at bfloat16 precision (greedy output may "
                            "differ); rank 0's choice applies to every rank")
    group.add_argument("--tp-timeout", type=seconds, default=DEFAULT_TP_TIMEOUT_S, metavar="S",
                       help="a rank that stops answering, or a step that takes longer, ends every rank with an "
                            f"error after S seconds (default {DEFAULT_TP_TIMEOUT_S:g})")


def _get(args: argparse.Namespace, name: str, default: Any = None) -> Any:
    return getattr(args, name, default)


def _check_modes(args: argparse.Namespace) -> None:
    for flag, name, what in (("--tp-embedding-mode", "tp_embedding_mode", "embedding table"),
                             ("--tp-lm-head-mode", "tp_lm_head_mode", "LM head")):
        if _get(args, name, DEFAULT_TP_VOCAB_MODE) != DEFAULT_TP_VOCAB_MODE:
            raise TPError(f"{flag} {_get(args, name)} is not supported: this runtime keeps the {what} replicated "
                          f"on every rank (use {flag} replicated, the default)")


def check_tp_flags(args: argparse.Namespace) -> None:
    """Flag combinations only (no files read)."""
    size = _get(args, "tp_size", DEFAULT_TP_SIZE)
    _check_modes(args)
    if size < 2:
        for flag, name in (("--tp-hostfile", "tp_hostfile"), ("--tp-rank", "tp_rank"), ("--tp-port", "tp_port")):
            if _get(args, name) is not None:
                raise TPError(f"{flag} needs --tp-size above 1")
        if _get(args, "tp_allow_plaintext_network", False):
            raise TPError(f"{PLAINTEXT_FLAG} needs --tp-size above 1 and a --tp-hostfile")
        if _get(args, "tp_reduce_dtype", DEFAULT_TP_REDUCE_DTYPE) != DEFAULT_TP_REDUCE_DTYPE:
            raise TPError("--tp-reduce-dtype needs --tp-size above 1 (one rank reduces nothing)")
        return
    hostfile, rank = _get(args, "tp_hostfile"), _get(args, "tp_rank")
    if rank is not None and hostfile is None:
        raise TPError("--tp-rank needs --tp-hostfile (without one, rank 0 starts every rank on this host)")
    if rank is not None and rank >= size:
        raise TPError(f"--tp-rank {rank} is out of range for --tp-size {size} (ranks 0 to {size - 1})")
    if _get(args, "tp_allow_plaintext_network", False) and hostfile is None:
        raise TPError(f"{PLAINTEXT_FLAG} needs a --tp-hostfile: without one every rank runs on this host over loopback")
    for flag, name in (("--distributed-config", "distributed_config"), ("--pp-auto", "pp_auto"),
                       ("--pp-layers", "pp_layers")):
        if _get(args, name) is not None:
            raise TPError(f"--tp-size {size} cannot be combined with {flag}: tensor parallelism runs the whole "
                          "model on every rank (pipeline stages are not sharded)")
    if _get(args, "node_role") in ("prefill", "decode", "router"):
        raise TPError(f"--tp-size {size} cannot be combined with --node-role {args.node_role}")
    if _get(args, "pp_peer", False):
        raise TPError(f"--tp-size {size} cannot be combined with --pp-peer")
    if _get(args, "pp_size", 1) > 1:
        raise TPError(f"--tp-size {size} cannot be combined with --pp-size {args.pp_size}")


def tp_secret(args: argparse.Namespace, tp: TPOptions) -> Any:
    """The control channel's secret: with a hostfile the cluster secret (fail closed: the channel crosses hosts);
    without one None, and nothing is read (no flag, no environment): rank 0 makes a fresh secret per launch for
    the ranks it starts (the reference: tensor parallelism inside one process does not read it)."""
    if tp.local:
        return None
    from mlxcel.cluster.secret import load_secret

    return load_secret(_get(args, "cluster_secret_file"), required=True)


def prepare_tp(args: argparse.Namespace, model_dir: Path, config: Mapping[str, Any]) -> TPOptions | None:
    """All checks before any weight is read; None when --tp-size is 1."""
    check_tp_flags(args)
    size = _get(args, "tp_size", DEFAULT_TP_SIZE)
    if size < 2:
        return None
    plan = check_shardable(config, size, model_dir, moe_mode=_get(args, "tp_moe_mode"))
    reduce_dtype = _get(args, "tp_reduce_dtype", DEFAULT_TP_REDUCE_DTYPE)
    if reduce_dtype != DEFAULT_TP_REDUCE_DTYPE and (plan.moe_mode or not FAMILIES[plan.family].linear_reduces):
        raise TPError(f"--tp-reduce-dtype {reduce_dtype} does not apply to this {plan.family} checkpoint: some of "
                      "its all-reduces run inside its MoE or linear-attention blocks, in the model's dtype "
                      "(use --tp-reduce-dtype model, the default)")
    allow = bool(_get(args, "tp_allow_plaintext_network", False))
    hostfile = None
    port = _get(args, "tp_port")
    if _get(args, "tp_hostfile") is not None:  # the caller loads the secret (fail closed): the channel crosses hosts
        hostfile = load_hostfile(args.tp_hostfile, size, allow_plaintext=allow)
        port = DEFAULT_TP_HOSTFILE_PORT if port is None else port
    options = TPOptions(size=size, plan=plan, backend=_get(args, "tp_backend", "auto"),
                        rank=_get(args, "tp_rank") or 0, hostfile=hostfile, port=port, allow_plaintext=allow,
                        timeout=_get(args, "tp_timeout", DEFAULT_TP_TIMEOUT_S),
                        reduce_dtype=reduce_dtype)
    if allow and hostfile is not None and hostfile.non_loopback():
        log.warning(PLAINTEXT_WARNING)
    return options
