"""Which exits of a supervised node are restarted, and after how long (pure: no processes, no clock).

The node TOML's ``[restart]`` table (``mlxcel/node/spec.py``)::

    [restart]
    policy = "on-failure"     # or "never": the supervisor only records how the node ended
    backoff_s = 0.5           # the first restart's delay; doubled with each quick failure in a row
    backoff_max_s = 30        # the delay never grows past this
    limit = 5                 # this many restarts in a row, each after a run shorter than reset_s: a crash loop
    reset_s = 10              # a run at least this long resets the delay and the count
    standby = true            # keep a warm standby of an mlxcel-server node for its next restart

Restarted (``on-failure``): a death by signal (SIGKILL, an OOM kill, SIGSEGV) and any exit status but
0 and 2. Never restarted: 0, a clean stop (SIGTERM or SIGINT drains and exits 0, and so does a stage
told SHUTDOWN), and 2, a usage error (argparse: the command line itself is wrong, so every restart
would fail the same way). Exit 1 is restarted: the engine exits 1 for every error it prints as one
``mlxcel: error:`` line, some of which pass (a tensor-parallel group that broke, stages not up
within ``startup_s``, a port still held by a dying process) and some of which do not (a bad
checkpoint); the crash-loop limit bounds the second kind. The same choice is rendered into the
systemd unit (``RestartPreventExitStatus=2``, ``StartLimitBurst``), so both supervisors agree.

``standby`` (``mlxcel node`` only; ``mlxcel/commands/standby.py``): while an ``mlxcel-server`` node
serves, its supervisor keeps a second copy of its command line that has done its imports and waits;
a restart hands over to it instead of starting from nothing.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass

from mlxcel import config as defaults

POLICIES = ("on-failure", "never")
FINAL_EXITS = {0: "it stopped cleanly (exit 0)", 2: "a usage error (exit 2): its command line is wrong"}


@dataclass(frozen=True)
class RestartPolicy:
    """The ``[restart]`` table of a node TOML."""

    policy: str = defaults.DEFAULT_NODE_RESTART_POLICY
    backoff_s: float = defaults.DEFAULT_NODE_RESTART_BACKOFF_S
    backoff_max_s: float = defaults.DEFAULT_NODE_RESTART_BACKOFF_MAX_S
    limit: int = defaults.DEFAULT_NODE_RESTART_LIMIT
    reset_s: float = defaults.DEFAULT_NODE_RESTART_RESET_S
    standby: bool = defaults.DEFAULT_NODE_RESTART_STANDBY


def exit_cause(returncode: int) -> str:
    """``exit 3`` or ``signal SIGKILL`` (a ``subprocess`` return code: negative for a signal)."""
    if returncode >= 0:
        return f"exit {returncode}"
    try:
        return f"signal {signal.Signals(-returncode).name}"
    except ValueError:
        return f"signal {-returncode}"


def no_restart_because(returncode: int, policy: RestartPolicy) -> str | None:
    """Why this exit is final (no restart), or None when it deserves one."""
    if policy.policy == "never":
        return f"{exit_cause(returncode)} and the restart policy is never"
    return FINAL_EXITS.get(returncode)


class Backoff:
    """The delays between restarts: doubling with each quick failure in a row, until the crash-loop limit."""

    def __init__(self, policy: RestartPolicy):
        self.policy = policy
        self.in_a_row = 0  # restarts since the last run that lasted reset_s

    def next_delay(self, ran_s: float) -> float | None:
        """The delay before restarting a node that ran ``ran_s`` seconds; None: a crash loop, give up."""
        if ran_s >= self.policy.reset_s:
            self.in_a_row = 0
        if self.in_a_row >= self.policy.limit:
            return None
        self.in_a_row += 1
        return min(self.policy.backoff_s * 2 ** (self.in_a_row - 1), self.policy.backoff_max_s)
