"""A node process started ahead of need: the supervisor's standby (``mlxcel/node/supervise.py``).

Starting ``mlxcel-server`` costs a few seconds of CPU before it reads anything: importing MLX,
mlx-lm, transformers, FastAPI and the roles (6 s of CPU here, 20 s of wall time on a loaded 2-core
box). A supervisor that keeps a standby pays that while the node serves, so a restart costs only
reading the configuration, binding and loading the weights. A standby is the node's own command
line with ``MLXCEL_NODE_STANDBY_FDS=<go>,<warm>`` in its environment: it imports, writes one byte to
``warm``, then blocks on ``go``. One byte ``g`` and it runs as the node from the start of
``mlxcel.commands.serve.run`` (so it reads the secret, the cluster TOML and the flags as they are then); anything
else (the supervisor stopped, closing the pipe) and it exits 0 having done nothing.
"""

from __future__ import annotations

import importlib
import os
import sys

from mlxcel import envs
from mlxcel.config import ENV_NODE_STANDBY_FDS

GO = b"g"
WARM = b"w"
# what a starting node imports before it reads its configuration (every role's; those missing are skipped)
WARM_MODULES = ("mlx.core", "mlx_lm.utils", "mlx_lm.models.cache", "transformers", "fastapi", "uvicorn",
                "mlxcel.loading_process", "mlxcel.server.app", "mlxcel.pipeline.stage", "mlxcel.pipeline.coordinator",
                "mlxcel.disagg.prefill", "mlxcel.disagg.decode", "mlxcel.disagg.router",
                "mlxcel.entrypoints.stage", "mlxcel.entrypoints.coordinator", "mlxcel.entrypoints.prefill", "mlxcel.entrypoints.decode",
                "mlxcel.entrypoints.router", "mlxcel.entrypoints.single")


def wait_if_standby() -> None:
    """As a standby: import what a start needs, say so, and wait for the go (exit 0 without one)."""
    fds = envs.take(ENV_NODE_STANDBY_FDS)
    if fds is None:
        return
    go_fd, warm_fd = (int(fd) for fd in fds.split(","))
    for name in WARM_MODULES:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a module this install lacks: the node imports what it needs
            pass
    try:
        os.write(warm_fd, WARM)
        os.close(warm_fd)
    except OSError:
        pass
    with os.fdopen(go_fd, "rb") as pipe:
        go = pipe.read(1)
    if go != GO:
        sys.exit(0)
