"""Real servers in subprocesses (``python -m mlxcel serve --port 0``), reached over loopback HTTP."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import httpx
import pytest

from tests.server.util import ServerProcess


@pytest.fixture(scope="session")
def start_server() -> Iterator:
    """Factory of servers; every one is stopped at the end of the session."""
    servers: list[ServerProcess] = []

    def start(model: Path, *flags: str, ready: bool = True, env: dict | None = None) -> ServerProcess:
        server = ServerProcess(model, *flags, env=env)
        servers.append(server)
        if ready:
            server.wait_ready()
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="module")
def server(start_server, tiny_llama) -> ServerProcess:
    """The shared server: 4 slots, batch 4."""
    return start_server(tiny_llama, "--parallel", "4", "--max-queue", "8")


@pytest.fixture
def client(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c
