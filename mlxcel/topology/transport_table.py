"""The cluster TOML's ``[transport]`` table: the transport caps an operator may set (reference, "Cluster
authentication": max_connections, the pending-handshake pool and its per-source share, the handshake
timeout, the reconnect budget), checked here and handed to every ``Transport`` of a node that reads the
TOML as ``TransportOptions`` overrides. Defaults are the transport's own (``mlxcel/cluster/wire.py``);
bounds are ``mlxcel/config.py``'s. Every problem is a ``ValueError`` naming the key (the loader adds the file).
"""

from __future__ import annotations

import math
from typing import Any

from mlxcel import config as bounds
from mlxcel.cluster import wire

#: TOML key -> (TransportOptions field, kind, low, high); ints are inclusive, seconds are (0, high]
KEYS: dict[str, tuple[str, type, float, float]] = {
    "max_connections": ("max_connections", int, 1, bounds.MAX_TRANSPORT_CONNECTIONS),
    "max_pending_handshakes": ("max_pending_handshakes", int, 1, bounds.MAX_TRANSPORT_CONNECTIONS),
    "max_pending_handshakes_per_ip": ("max_pending_handshakes_per_ip", int, 1, bounds.MAX_TRANSPORT_CONNECTIONS),
    "handshake_timeout_s": ("handshake_timeout", float, 0, bounds.MAX_HANDSHAKE_TIMEOUT_S),
    "max_reconnect_attempts": ("max_reconnect_attempts", int, 0, bounds.MAX_RECONNECT_ATTEMPTS),
    "reconnect_base_delay_s": ("reconnect_base_delay", float, 0, wire.RECONNECT_MAX_DELAY_S),
}

Overrides = tuple[tuple[str, Any], ...]  # (TransportOptions field, value) pairs: hashable, in key order


def _value(key: str, value: Any) -> Any:
    _, kind, low, high = KEYS[key]
    if kind is int:
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            raise ValueError(f"{key} under [transport] must be an integer from {low:g} to {high:g}, got {value!r}")
        return value
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or not low < value <= high):
        raise ValueError(f"{key} under [transport] must be a number of seconds above 0 and at most {high:g}, "
                         f"got {value!r}")
    return float(value)


def parse_transport_table(table: dict[str, Any]) -> Overrides:
    """The ``[transport]`` table's keys as ``TransportOptions`` overrides; ValueError naming a bad key."""
    unknown = sorted(set(table) - set(KEYS))
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(unknown)} in [transport] (known: {', '.join(sorted(KEYS))})")
    values = {key: _value(key, table[key]) for key in KEYS if key in table}
    total = values.get("max_pending_handshakes", wire.MAX_PENDING_HANDSHAKES)
    per_ip = values.get("max_pending_handshakes_per_ip", wire.MAX_PENDING_HANDSHAKES_PER_SOURCE)
    if per_ip > total:
        raise ValueError(f"max_pending_handshakes_per_ip under [transport] ({per_ip}) cannot exceed "
                         f"max_pending_handshakes ({total})")
    return tuple((KEYS[key][0], value) for key, value in values.items())
