"""Rank 0's side of a tensor-parallel group, from start-up to shutdown.

``start``: the control listener, the local followers (no hostfile), every rank's hello, then the
MLX group. ``shard``: shard rank 0's (lazily loaded) model, evaluate its slice, wait until every
follower is ready. ``executor``: the scheduler's ``TPExecutor``. ``close``: followers told to stop,
local ones waited for (SIGKILL after a grace), the control channel and temporary files gone.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any, Callable

from mlxcel.cluster.secret import ClusterSecret
from mlxcel.config import DEFAULT_KV_GROUP_SIZE
from mlxcel.parallel.control import RankZeroControl, encode
from mlxcel.parallel.errors import TPError
from mlxcel.parallel.executor import TPExecutor
from mlxcel.parallel.launch import (
    GroupSpec,
    LocalRanks,
    group_spec,
    init_group,
    join_seconds,
    launch_secret,
    resolve_backend,
)
from mlxcel.parallel.options import TPOptions
from mlxcel.parallel.plan import apply_plan

log = logging.getLogger("mlxcel.parallel")

def probe_interval(timeout: float) -> float:
    return max(0.05, min(1.0, timeout / 5))


class RankZero:
    """Rank 0 of a group: control channel, followers, MLX group, executor."""

    def __init__(self, tp: TPOptions, model_dir: Path, secret: ClusterSecret | None, *, max_batch_size: int,
                 prefix_cache_bytes: int, kv_bits: int | None = None, kv_group_size: int = DEFAULT_KV_GROUP_SIZE):
        from mlxcel.models.identity import model_identity

        if not tp.local and secret is None:
            raise TPError("a multi-host tensor-parallel group needs the cluster secret (--cluster-secret-file)")
        self.tp = tp
        self.model_dir = model_dir
        self.secret = secret if secret is not None else ClusterSecret(launch_secret(None), source="this launch")
        self.settings = {"identity": model_identity(model_dir), "max_batch_size": max_batch_size,
                         "prefix_cache_bytes": prefix_cache_bytes, "reduce_dtype": tp.reduce_dtype,
                         "moe_mode": tp.plan.moe_mode,
                         # --kv-bits: every rank quantizes its share of the KV cache alike (rank 0's choice)
                         "kv_bits": kv_bits, "kv_group_size": kv_group_size}
        self.local = LocalRanks() if tp.local else None
        self.control: RankZeroControl | None = None
        self.spec: GroupSpec | None = None
        self.group: Any = None
        self.executor_: TPExecutor | None = None

    @property
    def followers(self) -> set[int]:
        return set(range(1, self.tp.size))

    def _problem(self) -> str | None:
        return self.local.problem() if self.local is not None else None

    def start(self) -> Any:
        """Followers up and joined, the MLX group formed; returns the group."""
        tp = self.tp
        backend = resolve_backend(tp.backend, tp.hostfile)
        self.spec, control_addr = group_spec(tp, backend)
        self.control = RankZeroControl(self.secret, control_addr, tp.size, timeout=tp.timeout,
                                       settings=self.settings)
        host, port = self.control.start().address
        self.control.start_probe(probe_interval(tp.timeout))  # each follower hears from rank 0 from its hello on
        if self.local is not None:
            for rank in sorted(self.followers):
                self.local.spawn(rank, self._follower_argv(rank, f"{host}:{port}"), self.secret.reveal(),
                                 self._follower_env(rank))
        join = join_seconds(tp.timeout)
        self.control.wait("peers", self.followers, time.monotonic() + join, self._problem)
        self.group = init_group(self.spec, 0, join)
        log.info("tensor-parallel group: %d ranks on %s (%s)", tp.size, backend, tp.plan.describe())
        return self.group

    def _follower_argv(self, rank: int, control: str) -> list[str]:
        assert self.spec is not None
        return ["--rank", str(rank), "--model", str(self.model_dir), "--control", control,
                "--group", self.spec.to_json(), "--timeout", repr(self.tp.timeout), "--parent", str(os.getpid())]

    def _follower_env(self, rank: int) -> dict[str, str]:
        env = {"PYTHONUNBUFFERED": "1"}
        if self.spec is not None and self.spec.backend == "nccl":
            env["CUDA_VISIBLE_DEVICES"] = str(rank)
        return env

    def shard(self, model: Any) -> None:
        """Shard ``model`` (loaded lazily) over the group, load this rank's slice, wait for every follower."""
        import mlx.core as mx

        from mlxcel.parallel.reduce import set_reduce_dtype

        assert self.control is not None
        apply_plan(model, self.tp.plan, self.group)
        set_reduce_dtype(model, self.tp.reduce_dtype)
        mx.eval(model.parameters())
        self.control.wait("ready", self.followers, None, self._problem)

    def executor(self, model: Any, on_fatal: Callable[[str], None]) -> TPExecutor:
        assert self.control is not None
        self.executor_ = TPExecutor(model, self.control, max_batch_size=self.settings["max_batch_size"],
                                    prefix_cache_bytes=self.settings["prefix_cache_bytes"],
                                    step_timeout=self.tp.timeout, on_fatal=on_fatal)
        return self.executor_

    def close(self) -> None:
        """Stop the followers (if the executor did not already) and release everything; idempotent."""
        control, self.control = self.control, None
        if control is not None:
            if self.executor_ is None and control.peers:
                try:
                    control.broadcast(encode("shutdown", reason="rank 0 is stopping"))
                except Exception:  # noqa: BLE001 - they exit on their own once rank 0 is silent
                    pass
            if self.local is not None:
                self.local.stop()
            control.close()
        elif self.local is not None and self.local.procs:
            self.local.stop()
        self.local = None

    def explain(self, message: str) -> str:
        """``message``, led by the local follower that exited when one did (a killed rank is seen as a lost peer)."""
        deadline = time.monotonic() + 0.5
        while self.local is not None and time.monotonic() < deadline:
            problem = self.local.problem()
            if problem:
                return f"{problem}: {message}"
            time.sleep(0.05)
        return message

    def kill_followers(self) -> None:
        """Fatal path: stop local followers at once (by PID)."""
        if self.local is not None:
            self.local.stop(grace=0.5)
            self.local = None
