"""Role ``coordinator``: the OpenAI API over pipeline stages; this process holds no layers."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from mlxcel.errors import CLIError
from mlxcel.pipeline.runtime import Distributed, model_facts
from mlxcel.process import RoleContext
from mlxcel.server.runtime import ServerRuntime
from mlxcel.server.serve import serve_openai


def coordinator_factory(dist: Distributed, *, stop_stages: bool = False):
    """The server runtime's engine factory for the coordinator: a Scheduler over a PipelineExecutor."""

    def build(model: Any, tokenizer: Any, ctx: int, config: Any) -> Any:
        from mlxcel.engine.executor import ExecutorError
        from mlxcel.engine.scheduler import Scheduler
        from mlxcel.pipeline.coordinator import PipelineExecutor

        if dist.secret is None:
            raise CLIError("a pipeline needs the cluster secret")
        executor = PipelineExecutor(dist.cluster, dist.secret, model_facts(config.model),
                                    max_batch_size=config.max_batch_size, micro_batch_size=dist.micro_batch_size,
                                    return_logits=dist.return_logits, stop_stages_on_close=stop_stages)
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
    """Serve the OpenAI API, driving the stages of ``context.dist``, until stopped; returns the exit code."""
    dist = context.dist
    if dist is None:
        raise CLIError("the coordinator role needs --distributed-config and --node-id")
    config = replace(context.config, lazy_weights=True)  # the tokenizer and config only, never the weights
    runtime = ServerRuntime(config, coordinator_factory(dist, stop_stages=context.args.pp_stop_stages))
    return serve_openai(context, runtime, described_as=f" as coordinator of {len(dist.cluster.stages)} pipeline stages")
