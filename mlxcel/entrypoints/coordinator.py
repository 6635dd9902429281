"""Role ``coordinator``: the OpenAI API over pipeline stages; this process holds no layers."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from mlxcel.cluster.secret import ClusterSecret
from mlxcel.errors import CLIError
from mlxcel.models.facts import model_facts
from mlxcel.entrypoints.context import RoleContext, ServeConfig
from mlxcel.server.runtime import ServerRuntime
from mlxcel.server.openai_process import serve_openai
from mlxcel.topology.distributed import Distributed

if TYPE_CHECKING:
    from mlxcel.entrypoints.flags import ServeFlags


def configure(flags: ServeFlags, config: ServeConfig) -> ServeConfig:
    """The cluster TOML's coordinator node (loaded with the secret before the role was chosen)."""
    if config.dist is None:
        raise CLIError("the coordinator role needs --distributed-config and --node-id")
    return config


def coordinator_factory(dist: Distributed, secret: ClusterSecret | None, *, stop_stages: bool = False,
                        replacer: Any = None):
    """The server runtime's engine factory for the coordinator: a Scheduler over a PipelineExecutor."""

    def build(model: Any, tokenizer: Any, ctx: int, config: Any) -> Any:
        from mlxcel.engine.executor import ExecutorError, cap_rows
        from mlxcel.engine.scheduler import Scheduler
        from mlxcel.pipeline.coordinator import PipelineExecutor

        if secret is None:
            raise CLIError("a pipeline needs the cluster secret")
        executor = PipelineExecutor(dist.cluster, secret, model_facts(config.model),
                                    max_batch_size=config.max_batch_size, micro_batch_size=dist.micro_batch_size,
                                    return_logits=dist.return_logits, stop_stages_on_close=stop_stages,
                                    replacer=replacer,
                                    one_row=None if model is None else cap_rows(model))
        try:
            executor.start()
        except OSError as exc:
            executor.close()
            raise ExecutorError(f"cannot listen on the cluster address {dist.cluster.coordinator.address}: "
                                f"{exc.strerror or exc}") from None
        except BaseException:
            executor.close()
            raise
        engine = Scheduler(executor, tokenizer, context_length=ctx, parallel=config.parallel,
                           max_queue=config.max_queue, warmup=config.warmup)
        engine.start().wait_ready()
        return engine

    return build


def run(context: RoleContext) -> int:
    """Serve the OpenAI API, driving the stages of the cluster TOML, until stopped; returns the exit code."""
    dist = context.config.dist
    assert dist is not None  # configure checked it
    server = replace(context.config.server, lazy_weights=True)  # the tokenizer and config only, never the weights
    runtime = ServerRuntime(server, coordinator_factory(dist, context.config.secret, stop_stages=dist.options.stop_stages,
                                                        replacer=context.config.replacer))
    return serve_openai(context.endpoint, context.access, runtime,
                        described_as=f" as coordinator of {len(dist.cluster.stages)} pipeline stages")
