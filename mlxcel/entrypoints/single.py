"""Role ``single``: one process holds the whole model and serves the OpenAI API."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mlxcel.entrypoints.context import RoleContext, ServeConfig
from mlxcel.server.runtime import ServerRuntime
from mlxcel.server.openai_process import serve_openai

if TYPE_CHECKING:
    from mlxcel.entrypoints.flags import ServeFlags


def configure(flags: ServeFlags, config: ServeConfig) -> ServeConfig:
    """Nothing beyond the flags every role shares."""
    return config


def run(context: RoleContext) -> int:
    """Serve the model of ``context.config`` until stopped; returns the exit code."""
    return serve_openai(context.endpoint, context.access, ServerRuntime(context.config.server))
