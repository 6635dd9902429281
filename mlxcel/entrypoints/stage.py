"""Role ``stage``: one pipeline stage's slice on the cluster transport, /health on --host/--port."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from mlxcel import envs
from mlxcel.cluster.secret import ClusterSecret
from mlxcel.errors import CLIError
from mlxcel.loading_process import LoadingProcess, serve_loading
from mlxcel.models.facts import model_facts
from mlxcel.pipeline.slice_loading import load_stage_runner
from mlxcel.pipeline.stage import StageService
from mlxcel.entrypoints.context import RoleContext, ServeConfig
from mlxcel.topology.distributed import Distributed

if TYPE_CHECKING:
    from mlxcel.entrypoints.flags import ServeFlags
    from mlxcel.server.runtime import ServerConfig
    from mlxcel.topology.cluster_config import ClusterConfig

log = logging.getLogger("mlxcel.pipeline.stage")


class StageProcess(LoadingProcess):
    """Loading -> ready (serving on the transport) | failed; /health reports which."""

    service: StageService | None

    def __init__(self, dist: Distributed, model_dir: Path, secret: ClusterSecret | None,
                 prepare: Callable[[Any], None] | None = None):
        super().__init__()
        self.dist = dist
        self.prepare = prepare  # sees the model before its slice is cut (--kv-bits)
        self.secret = secret
        self.model_dir = model_dir

    def load(self, on_fatal: Callable[[str], None], on_shutdown: Callable[[], None]) -> None:
        node, loaded = self.dist.node, []

        def build() -> StageService:
            if node.layers is None or self.secret is None:
                raise ValueError("a stage needs its layer range and the cluster secret")
            runner, checkpoint = load_stage_runner(self.model_dir, *node.layers,
                                                   max_rows=self.dist.cluster.max_batch_size, prepare=self.prepare)
            loaded.append(checkpoint)
            return StageService(self.dist.cluster, node.id, runner, self.secret, model_facts(self.model_dir),
                                on_shutdown=on_shutdown,
                                step_delay_s=envs.settings().test_stage_step_delay_s)  # test only

        seconds = self.start_service(build, who=f"stage {node.id}", address=node.address, on_fatal=on_fatal)
        if seconds is not None and node.layers is not None:
            log.info("stage %s serving layers %d-%d of %s (%s) on %s in %.1fs", node.id, node.layers[0],
                     node.layers[1] - 1, loaded[0].name, loaded[0].describe_weights(), node.address, seconds)

    def health_body(self) -> dict[str, Any]:
        node = self.dist.node
        body: dict[str, Any] = {"status": self.state, "role": "stage", "node_id": node.id,
                                "layers": list(node.layers or ())}
        if self.service is not None:
            body.update(sequences=len(self.service.runner), draining=self.service.draining,
                        cancelled=self.service.cancels)
        return body


def configure(flags: ServeFlags, config: ServeConfig) -> ServeConfig:
    """The cluster TOML's stage node (loaded with the secret before the role was chosen), and its --kv-bits."""
    if config.dist is None:
        raise CLIError("the stage role needs --distributed-config and --node-id")
    return replace(config, server=stage_kv_bits(config.server, config.dist.cluster))


def stage_kv_bits(server: ServerConfig, cluster: ClusterConfig) -> ServerConfig:
    """The stage's KV quantization: the TOML's [pipeline] kv_bits / kv_group_size where it gives them, else the
    stage's own --kv-bits / --kv-group-size; both given and different: refused by name."""
    if cluster.kv_bits is None:
        return server
    toml = (cluster.kv_bits, cluster.kv_group_size)
    if server.kv_bits is not None and (server.kv_bits, server.kv_group_size) != toml:
        raise CLIError(f"--kv-bits {server.kv_bits} --kv-group-size {server.kv_group_size} differs from {cluster.path}'s "
                       f"[pipeline] kv_bits = {toml[0]}, kv_group_size = {toml[1]}; give one of them")
    return replace(server, kv_bits=toml[0], kv_group_size=toml[1])


def run(context: RoleContext) -> int:
    """Role ``stage``: serve this node's layers until SIGINT/SIGTERM or the coordinator's SHUTDOWN;
    returns the exit code."""
    dist = context.config.dist
    assert dist is not None  # configure checked it
    server = context.config.server
    process = StageProcess(dist, server.model, context.config.secret, prepare=server.apply_kv_bits)
    layers = dist.node.layers or (0, 0)
    banner = f"mlxcel: stage {dist.node.id} (layers {layers[0]}-{layers[1] - 1}) on cluster address {dist.node.address}"
    return serve_loading(context.endpoint, process, "mlxcel stage", lambda switch: process.load(switch.fatal, switch.stop),
                         "mlxcel-stage-load", banner)
