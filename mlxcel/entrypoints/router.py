"""Role ``router``: the OpenAI API over prefill and decode nodes; this process holds no weights.

Same endpoints, errors and access control as a single node, plus ``GET /router/stats`` (behind the
API key like every endpoint but /health): addresses redacted unless ``MLXCEL_ROUTER_STATS_VERBOSE``
is 1, true, yes or on.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse

from mlxcel import envs
from mlxcel.cluster.secret import ClusterSecret
from mlxcel.disagg.flags import NodeConfig, node_config
from mlxcel.entrypoints.context import RoleContext, ServeConfig
from mlxcel.server.runtime import ServerRuntime
from mlxcel.server.openai_process import serve_openai

if TYPE_CHECKING:
    from mlxcel.entrypoints.flags import ServeFlags


def stats_verbose(env: dict[str, str] | None = None) -> bool:
    return (envs.settings() if env is None else envs.read(env)).router_stats_verbose


def router_factory(cfg: NodeConfig, secret: ClusterSecret):
    """The server runtime's engine factory: a ``RouterEngine`` over the configured nodes."""

    def build(model: Any, tokenizer: Any, ctx: int, config: Any) -> Any:
        from mlxcel.disagg.router_engine import RouterEngine
        from mlxcel.models.facts import model_facts
        from mlxcel.models.identity import model_identity

        engine = RouterEngine(cfg, tokenizer, secret=secret, context_length=ctx, identity=model_identity(config.model),
                              vocab_size=model_facts(config.model).vocab_size)
        try:
            return engine.start()
        except BaseException:
            engine.close()
            raise

    return build


def configure(flags: ServeFlags, config: ServeConfig) -> ServeConfig:
    """The prefill and decode nodes it balances (flags or the cluster TOML; the secret is the command's)."""
    return replace(config, disagg=node_config(flags.disagg, config.dist, flags.resume.max_resumes,
                                              flags.resume.resume_timeout, flags.server.max_queue))


def stats_route(runtime: ServerRuntime, verbose: bool):
    """``GET /router/stats`` on the app (behind the API key like every endpoint but /health)."""

    def add(app: Any) -> None:
        @app.get("/router/stats")
        async def router_stats(_: Request) -> JSONResponse:
            engine = runtime.engine
            if engine is None:
                return JSONResponse({"status": runtime.state}, status_code=503, headers={"Retry-After": "1"})
            return JSONResponse(engine.router_stats(verbose))  # type: ignore[attr-defined]

    return add


def run(context: RoleContext) -> int:
    """Serve the OpenAI API and /router/stats until SIGINT/SIGTERM; returns the exit code."""
    cfg = context.config.disagg
    assert cfg is not None  # configure set it
    server = replace(context.config.server, lazy_weights=True)  # the tokenizer and config only
    assert context.config.secret is not None  # every disaggregated role needs it (fail closed)
    runtime = ServerRuntime(server, router_factory(cfg, context.config.secret))
    return serve_openai(context.endpoint, context.access, runtime, routes=stats_route(runtime, stats_verbose()),
                        described_as=f" as router over {len(cfg.prefill_peers)} prefill and {len(cfg.decode_peers)} "
                                     "decode nodes", details=f"cluster address {cfg.serving_bind}")
