"""The compute-thread budget of one process, and BLAS worker threads that sleep while the process waits.

MLX's CPU backend runs every operation of a stream on one thread; its float32 matrix products go to
the OpenBLAS that ``mlxcel/blas.py`` preloads, whose pool of worker threads is the only parallelism.
Two knobs, both applied to that OpenBLAS:

* Idle workers sleep soon. An OpenBLAS worker spins (``sched_yield``) for ``2**28`` TSC cycles,
  about 0.1 s, after each job before it sleeps. A pipeline stage waits for its peers for less than
  that between two steps, so its workers never slept: each stage of a one-stream pipeline burnt a
  whole core while the other stage worked, on the core that stage needed. Before OpenBLAS loads,
  ``blas_environment`` sets ``OPENBLAS_THREAD_TIMEOUT`` to ``config.BLAS_THREAD_TIMEOUT_LOG2``
  (about 0.4 ms) unless the environment already sets it.
* The budget: how many threads (the calling one included) one matrix product may use. Several
  nodes on one host should split its cores (``--threads N``, else ``MLXCEL_THREADS``); left unset,
  ``OPENBLAS_NUM_THREADS`` stands, else every core the process may run on but one, at least one
  (``mlxcel.blas.default_threads``: recent OpenBLAS builds spin while they wait for a busy core).

Policy only (no library is touched here): ``mlxcel/blas.py`` loads OpenBLAS with ``blas_environment``
and applies a budget at run time (``apply_thread_budget``).

One more knob is the interpreter's own: the GIL switch interval of a process whose transport threads
(readers, senders, handoff intake) share the GIL with a step thread that builds graphs in Python. A thread
that returns from ``recv``/``sendmsg``/AES (all release the GIL) waits for the GIL until the step thread
lets go, which CPython forces only every switch interval (5 ms by default): a 256 KiB frame costs a few
such waits, so a bulk stream crawls beside a busy step thread (``bench/gil_bench.py``: 64 MiB in 2.5-2.8 s
instead of 54-64 ms). ``transport_switch_interval`` is the interval the disaggregated prefill and decode
nodes set (``TRANSPORT_SWITCH_INTERVAL_MS``, ``MLXCEL_SWITCH_INTERVAL_MS`` overrides).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from mlxcel import config, envs

TIMEOUT_ENVS = ("OPENBLAS_THREAD_TIMEOUT", "GOTO_THREAD_TIMEOUT")
#: the GIL switch interval (ms) of a process whose transport threads move bulk data beside a step thread
TRANSPORT_SWITCH_INTERVAL_MS = 0.5


def available_cores() -> int:
    """Cores this process may run on (its affinity mask), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def env_budget(environ: Mapping[str, str] | None = None) -> int | None:
    """``MLXCEL_THREADS`` as a budget (of ``environ``, else the settings); None when unset or empty. Raises
    ``envs.EnvError`` (a ValueError) naming the variable."""
    return envs.settings().threads if environ is None else envs.get("MLXCEL_THREADS", environ)


def blas_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables to set before OpenBLAS loads: the short idle timeout and ``MLXCEL_THREADS``'s budget.

    An invalid ``MLXCEL_THREADS`` is left out here; the server refuses it with ``env_budget``'s message.
    """
    extra: dict[str, str] = {}
    if not any(environ.get(name) for name in TIMEOUT_ENVS):
        extra["OPENBLAS_THREAD_TIMEOUT"] = str(config.BLAS_THREAD_TIMEOUT_LOG2)
    try:
        budget = env_budget(environ)
    except ValueError:
        budget = None
    if budget is not None:
        extra["OPENBLAS_NUM_THREADS"] = str(budget)
    return extra


def transport_switch_interval() -> float:
    """The switch interval in seconds for ``sys.setswitchinterval``: ``MLXCEL_SWITCH_INTERVAL_MS`` if set
    (0.01-100 ms; ValueError naming it otherwise), else ``TRANSPORT_SWITCH_INTERVAL_MS``."""
    ms = envs.settings().switch_interval_ms
    return (TRANSPORT_SWITCH_INTERVAL_MS if ms is None else ms) / 1000
