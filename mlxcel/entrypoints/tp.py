"""Role ``tp``: rank 0 of a tensor-parallel group serves the OpenAI API (``mlxcel-server --tp-size N``).

The engine is the usual ``Scheduler`` over a ``TPExecutor``: under ``--parallel N`` one batched decode
step of every running row per rank and layer (``decode path: native batched forward``). When the
group breaks (a rank died or hangs) every request in flight and every new one gets 503, one line
says why, the server drains (``--drain-timeout``) and exits 1; the local followers are stopped.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlxcel.process import error_line
from mlxcel.entrypoints.context import RoleContext, ServeConfig
from mlxcel.server.runtime import ServerConfig, ServerRuntime
from mlxcel.server.openai_process import serve_openai

if TYPE_CHECKING:
    from mlxcel.entrypoints.flags import ServeFlags

DECODE_PATH = "decode path: native batched forward"


def configure(flags: ServeFlags, config: ServeConfig) -> ServeConfig:
    """The shard plan and the group's settings (checked before any weight is read); the command loads the cluster
    secret with a hostfile (fail closed: the control channel crosses hosts; without one none is read)."""
    from mlxcel.models.loading import check_checkpoint
    from mlxcel.parallel.options import prepare_tp

    tp = prepare_tp(flags.tp, config.server.model, check_checkpoint(config.server.model))
    assert tp is not None  # the role is chosen by --tp-size above 1
    return replace(config, tp=tp)


class TPServer:
    """The rank-0 session of a server and what its engine factory needs."""

    def __init__(self, context: RoleContext):
        from mlxcel.parallel.session import RankZero

        config = context.config.server
        tp = context.config.tp
        assert tp is not None  # configure set it
        self.tp = tp
        self.rank0 = RankZero(tp, Path(config.model), context.config.secret, max_batch_size=config.max_batch_size,
                              prefix_cache_bytes=config.prefix_cache_mb << 20, kv_bits=config.kv_bits,
                              kv_group_size=config.kv_group_size)
        self.error: str | None = None
        self._once = threading.Lock()

    def build(self, model: Any, tokenizer: Any, ctx: int, config: ServerConfig) -> Any:
        """The engine factory: group up, model sharded, scheduler warmed up."""
        from mlxcel.engine.scheduler import Scheduler

        self.rank0.start()
        self.rank0.shard(model)
        executor = self.rank0.executor(model, self.fatal)
        engine = Scheduler(executor, tokenizer, context_length=ctx, parallel=config.parallel,
                           max_queue=config.max_queue, warmup=config.warmup)
        engine.start().wait_ready()
        return engine

    def fatal(self, message: str) -> None:
        """The group broke: one line, followers stopped, then the server drains and exits 1."""
        if not self._once.acquire(blocking=False):
            return
        self.error = message = self.rank0.explain(message)
        error_line(f"{message}; stopping (requests get 503 until the server is gone)")
        self.rank0.kill_followers()
        os.kill(os.getpid(), signal.SIGTERM)  # uvicorn's own graceful stop, bounded by --drain-timeout


def run(context: RoleContext) -> int:
    """Serve as rank 0 of ``--tp-size`` ranks until stopped; 1 when the group broke."""
    server = TPServer(context)
    config = replace(context.config.server, lazy_weights=True)  # the weights are read only once sharded
    reduce = "" if server.tp.reduce_dtype == "model" else f", all-reduce in {server.tp.reduce_dtype}"
    print(f"mlxcel: tensor parallel over {server.tp.size} ranks ({server.tp.plan.describe()}{reduce}); {DECODE_PATH}",
          file=sys.stderr, flush=True)
    try:
        code = serve_openai(context.endpoint, context.access, ServerRuntime(config, server.build),
                            described_as=f" as rank 0 of {server.tp.size} tensor-parallel ranks")
    finally:
        server.rank0.close()
    return 1 if server.error is not None else code
