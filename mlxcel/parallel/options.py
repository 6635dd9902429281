"""``--tp-*`` flags: definitions and every check that needs no weights (defaults and bounds: ``mlxcel.config``).

``TPFlags`` (``add_arguments`` = ``add_tp_arguments``) is the group on ``mlxcel generate`` and the server;
its ``check`` refuses flag combinations once per start; ``prepare_tp`` checks the hostfile and the shard
plan (config.json only) and returns ``TPOptions``, or None when tensor parallelism is off. Imports no MLX (the backend check imports it only when asked).
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
from mlxcel.flagset import FlagSet
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


@dataclass(frozen=True)
class TPFlags(FlagSet):
    """The ``--tp-*`` flags as parsed (``add_tp_arguments``); ``check`` refuses bad combinations, reading no file."""

    tp_size: int = DEFAULT_TP_SIZE
    tp_backend: str = "auto"
    tp_hostfile: str | None = None
    tp_rank: int | None = None
    tp_port: int | None = None
    tp_allow_plaintext_network: bool = False
    tp_embedding_mode: str = DEFAULT_TP_VOCAB_MODE
    tp_lm_head_mode: str = DEFAULT_TP_VOCAB_MODE
    tp_moe_mode: str | None = None
    tp_reduce_dtype: str = DEFAULT_TP_REDUCE_DTYPE
    tp_timeout: float = DEFAULT_TP_TIMEOUT_S

    add_arguments = staticmethod(add_tp_arguments)

    @property
    def enabled(self) -> bool:
        return self.tp_size > 1

    def _check_modes(self) -> None:
        for flag, value, what in (("--tp-embedding-mode", self.tp_embedding_mode, "embedding table"),
                                  ("--tp-lm-head-mode", self.tp_lm_head_mode, "LM head")):
            if value != DEFAULT_TP_VOCAB_MODE:
                raise TPError(f"{flag} {value} is not supported: this runtime keeps the {what} replicated "
                              f"on every rank (use {flag} replicated, the default)")

    def _check_off(self) -> None:
        for flag, value in (("--tp-hostfile", self.tp_hostfile), ("--tp-rank", self.tp_rank),
                            ("--tp-port", self.tp_port)):
            if value is not None:
                raise TPError(f"{flag} needs --tp-size above 1")
        if self.tp_allow_plaintext_network:
            raise TPError(f"{PLAINTEXT_FLAG} needs --tp-size above 1 and a --tp-hostfile")
        if self.tp_reduce_dtype != DEFAULT_TP_REDUCE_DTYPE:
            raise TPError("--tp-reduce-dtype needs --tp-size above 1 (one rank reduces nothing)")

    def check(self, *, distributed_config: str | None = None, pp_auto: int | None = None,
              pp_layers: str | None = None, node_role: str | None = None, pp_peer: bool = False,
              pp_size: int = 1) -> None:
        """Flag combinations only (no files read); the keywords are the other features' flags it excludes."""
        size = self.tp_size
        self._check_modes()
        if size < 2:
            self._check_off()
            return
        hostfile, rank = self.tp_hostfile, self.tp_rank
        if rank is not None and hostfile is None:
            raise TPError("--tp-rank needs --tp-hostfile (without one, rank 0 starts every rank on this host)")
        if rank is not None and rank >= size:
            raise TPError(f"--tp-rank {rank} is out of range for --tp-size {size} (ranks 0 to {size - 1})")
        if self.tp_allow_plaintext_network and hostfile is None:
            raise TPError(f"{PLAINTEXT_FLAG} needs a --tp-hostfile: without one every rank runs on this host over "
                          "loopback")
        for flag, value in (("--distributed-config", distributed_config), ("--pp-auto", pp_auto),
                            ("--pp-layers", pp_layers)):
            if value is not None:
                raise TPError(f"--tp-size {size} cannot be combined with {flag}: tensor parallelism runs the whole "
                              "model on every rank (pipeline stages are not sharded)")
        if node_role in ("prefill", "decode", "router"):
            raise TPError(f"--tp-size {size} cannot be combined with --node-role {node_role}")
        if pp_peer:
            raise TPError(f"--tp-size {size} cannot be combined with --pp-peer")
        if pp_size > 1:
            raise TPError(f"--tp-size {size} cannot be combined with --pp-size {pp_size}")


def prepare_tp(flags: TPFlags, model_dir: Path, config: Mapping[str, Any]) -> TPOptions | None:
    """Every check that reads config.json (the flags were checked once, ``TPFlags.check``), before any weight is
    read; None when --tp-size is 1. With a hostfile the caller loads the cluster secret (fail closed)."""
    size = flags.tp_size
    if size < 2:
        return None
    plan = check_shardable(config, size, model_dir, moe_mode=flags.tp_moe_mode)
    reduce_dtype = flags.tp_reduce_dtype
    if reduce_dtype != DEFAULT_TP_REDUCE_DTYPE and (plan.moe_mode or not plan.tp_family.linear_reduces):
        raise TPError(f"--tp-reduce-dtype {reduce_dtype} does not apply to this {plan.family} checkpoint: some of "
                      "its all-reduces run inside its MoE or linear-attention blocks, in the model's dtype "
                      "(use --tp-reduce-dtype model, the default)")
    allow = flags.tp_allow_plaintext_network
    hostfile = None
    port = flags.tp_port
    if flags.tp_hostfile is not None:  # the caller loads the secret (fail closed): the channel crosses hosts
        hostfile = load_hostfile(flags.tp_hostfile, size, allow_plaintext=allow)
        port = DEFAULT_TP_HOSTFILE_PORT if port is None else port
    options = TPOptions(size=size, plan=plan, backend=flags.tp_backend, rank=flags.tp_rank or 0, hostfile=hostfile,
                        port=port, allow_plaintext=allow, timeout=flags.tp_timeout, reduce_dtype=reduce_dtype)
    if allow and hostfile is not None and hostfile.non_loopback():
        log.warning(PLAINTEXT_WARNING)
    return options
