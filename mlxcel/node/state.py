"""The supervisor's record of one node: ``<pidfile>.state``, a JSON object written atomically.

Written by ``mlxcel node supervise`` at every change, read by ``mlxcel node status|stop|wait``::

    {"supervisor_pid": 4100,          # the supervising process
     "pid": 4102,                     # the node's process now (null while it is down)
     "state": "running",              # starting | running | restarting | crash-loop | failed | exited | stopped
     "restarts": 1,                   # restarts since this supervisor started
     "last_cause": "signal SIGKILL",  # how the node last ended (exit N or signal NAME), null before any end
     "last_exit": "2026-12-02T01:10:00Z",
     "last_heal_s": 4.2,              # from the last death to ready again, null before any
     "killed": false,                 # on stop: whether the node needed SIGKILL after the grace
     "standby_pid": 4130,             # the warm standby for the next restart (null when none)
     "standby_warm": true,            # whether it has done its imports
     "message": "..."}                # the last thing the supervisor logged about it

``starting``: the first run, not ready yet; ``running``: ready (or, with no readiness URL, alive);
``restarting``: dead, restart pending; ``crash-loop``: gave up after ``[restart] limit`` quick failures
in a row; ``failed``: ended and not restarted (it never got ready on its first run, or exit 2, or policy
never); ``exited``: ended cleanly (exit 0); ``stopped``: stopped by ``mlxcel node stop`` or a signal to
the supervisor. The last four are final: the supervisor has exited.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

STATES = ("starting", "running", "restarting", "crash-loop", "failed", "exited", "stopped")
FINAL = ("crash-loop", "failed", "exited", "stopped")


@dataclass
class SupervisorState:
    """One node's supervision, as ``<pidfile>.state`` holds it."""

    supervisor_pid: int
    pid: int | None = None
    state: str = "starting"
    restarts: int = 0
    last_cause: str | None = None
    last_exit: str | None = None
    last_heal_s: float | None = None
    killed: bool = False
    standby_pid: int | None = None
    standby_warm: bool = False
    message: str = ""

    def write(self, path: Path) -> None:
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(asdict(self)) + "\n")
        os.replace(tmp, path)


def read_state(path: Path) -> SupervisorState | None:
    """The recorded state, or None when there is none (or it is unreadable)."""
    try:
        doc = json.loads(path.read_text())
        return SupervisorState(**doc) if isinstance(doc, dict) else None
    except (OSError, ValueError, TypeError):
        return None


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
