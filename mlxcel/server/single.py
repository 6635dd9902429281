"""Role ``single``: one process holds the whole model and serves the OpenAI API."""

from __future__ import annotations

from mlxcel.process import RoleContext
from mlxcel.server.runtime import ServerRuntime
from mlxcel.server.serve import serve_openai


def run(context: RoleContext) -> int:
    """Serve the model of ``context.config`` until stopped; returns the exit code."""
    return serve_openai(context, ServerRuntime(context.config))
