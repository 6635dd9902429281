"""Ports for test nodes that are written into a config before anything binds them.

A port that ``bind((host, 0))`` returned is in the kernel's ephemeral range (``ip_local_port_range``,
32768-60999 here), so by the time the node binds it, seconds or minutes later, the kernel may have given
it to someone else: an outgoing connection whose source address is that host (every cluster node
dials from its own identity), or another xdist worker's node. That is how a module-scoped cluster TOML
came to meet ``Address already in use`` in CI.

So these ports come from below the ephemeral range, where the kernel never hands out a port, in one
block per xdist worker (``PYTEST_XDIST_WORKER``), never twice in one process, and each is checked
free on every host named at the moment it is handed out.
"""

from __future__ import annotations

import os
import random
import socket

LOW, HIGH = 20_000, 32_000  # below 32768 (the ephemeral range's floor) and below the TP default, 32323
_handed_out: set[int] = set()
_cursor: int | None = None


def _block() -> range:
    """This process's share of ``LOW..HIGH``: one block per xdist worker (the whole range without xdist)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    index = int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else 0
    size = (HIGH - LOW) // max(count, 1)
    start = LOW + (index % max(count, 1)) * size
    return range(start, start + size)


def _bindable(host: str, port: int, kind: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, kind) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(*hosts: str, kind: int = socket.SOCK_STREAM, avoid: tuple[int, ...] = ()) -> int:
    """A port free on every one of ``hosts`` (127.0.0.1 if none) now, outside the kernel's ephemeral
    range, that this process never handed out before and that is not in ``avoid``."""
    global _cursor
    block = _block()
    if _cursor is None:
        _cursor = random.randrange(len(block))
    for _ in range(len(block)):
        _cursor = (_cursor + 1) % len(block)
        port = block[_cursor]
        if port in _handed_out or port in avoid:
            continue
        if all(_bindable(h, port, kind) for h in hosts or ("127.0.0.1",)):
            _handed_out.add(port)
            return port
    raise RuntimeError(f"no free test port left in {block.start}-{block.stop - 1}")


def free_ports(n: int, *hosts: str) -> list[int]:
    """``n`` distinct ports, each as ``free_port(*hosts)``."""
    return [free_port(*hosts) for _ in range(n)]
