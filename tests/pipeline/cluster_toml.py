"""Cluster TOML text for the config tests: the coordinator and first stage's node blocks, and the file."""

from __future__ import annotations

from pathlib import Path

COORDINATOR_AND_STAGE_0 = """[[nodes]]
id = "coordinator"
role = "coordinator"
address = "127.0.0.2:19000"
[[nodes]]
id = "stage-0"
role = "stage"
address = "127.0.0.3:19001"
"""


def write_toml(tmp_path: Path, text: str) -> Path:
    """``text`` written to ``tmp_path/cluster.toml``; returns the path."""
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    return path
