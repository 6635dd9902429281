"""Role ``decode``: adopt KV handoffs and stream tokens to the router; /health on --host/--port.

Its hooks are the disaggregated node's (``mlxcel/entrypoints/disagg_node.py``): the node's role in its
``NodeConfig`` picks the service it runs once loaded."""

from __future__ import annotations

from mlxcel.entrypoints.disagg_node import configure, run

__all__ = ["configure", "run"]
