"""The node supervisor's one error: a node TOML that cannot be read or is invalid."""

from __future__ import annotations


class NodeSpecError(ValueError):
    """The node TOML is unreadable or invalid; the message names the file and the key."""
