"""A prefill or decode process: the model loads in the background, /health on --host/--port says how it goes.

The HTTP port serves only ``/health`` (no API key needed): 503 while loading, 200 with the service's
state (sequences holding KV, handoffs arriving, counters) once it serves on its role transport.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable

from mlxcel.cluster.secret import ClusterSecret
from mlxcel.disagg.flags import NodeConfig, node_config
from mlxcel.entrypoints.context import RoleContext, ServeConfig
from mlxcel.loading_process import LoadingProcess, serve_loading
from mlxcel.process import Endpoint
from mlxcel.server.runtime import ServerConfig

if TYPE_CHECKING:
    from mlxcel.entrypoints.flags import ServeFlags

log = logging.getLogger("mlxcel.disagg")


class WorkerProcess(LoadingProcess):
    """Loading -> ready (serving on the role transport) | failed."""

    def __init__(self, server: ServerConfig, cfg: NodeConfig, secret: ClusterSecret):
        super().__init__()
        self.server = server
        self.cfg = cfg
        self.secret = secret

    def load(self, on_fatal: Callable[[str], None]) -> None:
        from mlxcel.models.identity import model_identity
        from mlxcel.models.loading import load_checkpoint
        from mlxcel.models.facts import context_length

        config, loaded = self.server, []

        def build() -> Any:
            checkpoint = load_checkpoint(config.model)
            config.apply_kv_bits(checkpoint.model)  # before the services probe the KV layout they hand off
            loaded.append(checkpoint)
            kwargs: dict[str, Any] = dict(identity=model_identity(config.model),
                                          context_length=context_length(checkpoint.config), parallel=config.parallel,
                                          max_batch_size=config.max_batch_size, max_queue=config.max_queue,
                                          warmup=config.warmup, secret=self.secret)
            if self.cfg.role == "prefill":
                from mlxcel.disagg.prefill import PrefillService

                return PrefillService(self.cfg, checkpoint.model, checkpoint.tokenizer,
                                      prefix_cache_bytes=config.prefix_cache_mb << 20, **kwargs)
            from mlxcel.disagg.decode import DecodeService

            return DecodeService(self.cfg, checkpoint.model, checkpoint.tokenizer, **kwargs)

        seconds = self.start_service(build, who=f"{self.cfg.role} node", address=self.cfg.serving_bind,
                                     on_fatal=on_fatal)
        if seconds is not None:
            log.info("%s node serving %s on cluster address %s in %.1fs", self.cfg.role, loaded[0].name,
                     self.service.transport.identity, seconds)

    def health_body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"status": self.state, "role": self.cfg.role, "node_id": self.cfg.node_id,
                                "switch_interval_ms": round(sys.getswitchinterval() * 1000, 3)}
        if self.service is not None:
            body.update(self.service.state(), draining=self.service.draining)
        return body


def run_worker(endpoint: Endpoint, server: ServerConfig, cfg: NodeConfig, secret: ClusterSecret) -> int:
    """Serve a prefill or decode node until SIGINT/SIGTERM; returns the exit code. Its handoff threads share
    the GIL with the step thread, so the GIL changes hands every ``cfg.switch_interval_s`` (mlxcel/threads.py)."""
    sys.setswitchinterval(cfg.switch_interval_s)
    process = WorkerProcess(server, cfg, secret)
    return serve_loading(endpoint, process, f"mlxcel {cfg.role}", lambda switch: process.load(switch.fatal),
                         f"mlxcel-{cfg.role}-load", f"mlxcel: {cfg.role} node on cluster address {cfg.serving_bind}")


# -- the two roles' hooks (``prefill`` and ``decode`` differ only in what their service does once loaded) --


def configure(flags: ServeFlags, config: ServeConfig) -> ServeConfig:
    """The node's addresses and peers (flags or the cluster TOML; the secret is the command's, fail closed)."""
    return replace(config, disagg=node_config(flags.disagg, config.dist, flags.resume.max_resumes,
                                              flags.resume.resume_timeout, flags.server.max_queue))


def run(context: RoleContext) -> int:
    assert context.config.disagg is not None  # configure set it
    assert context.config.secret is not None  # every disaggregated role needs it (fail closed)
    return run_worker(context.endpoint, context.config.server, context.config.disagg, context.config.secret)
