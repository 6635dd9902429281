"""Role ``decode``: adopt KV handoffs and stream tokens to the router; /health on --host/--port."""

from __future__ import annotations

from mlxcel.disagg.worker import run_worker
from mlxcel.process import RoleContext


def run(context: RoleContext) -> int:
    return run_worker(context)
