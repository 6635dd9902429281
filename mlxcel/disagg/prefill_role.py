"""Role ``prefill``: run prompts and hand their KV caches to decode nodes; /health on --host/--port."""

from __future__ import annotations

from mlxcel.disagg.worker import run_worker
from mlxcel.process import RoleContext


def run(context: RoleContext) -> int:
    return run_worker(context)
