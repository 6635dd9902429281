"""Role ``prefill``: run prompts and hand their KV caches to decode nodes; /health on --host/--port.

Its hooks are the disaggregated node's (``mlxcel/entrypoints/disagg_node.py``): the node's role in its
``NodeConfig`` picks the service it runs once loaded."""

from __future__ import annotations

from mlxcel.entrypoints.disagg_node import configure, run

__all__ = ["configure", "run"]
