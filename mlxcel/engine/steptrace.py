"""An opt-in per-step timeline of the scheduler thread (``MLXCEL_STEP_TRACE=FILE.jsonl``).

Each pass of the scheduler loop that ran or applied a step writes one JSON line: when it began
(``t``, seconds since the trace opened), its wall time, the steps it submitted and applied (kind and
rows), and the milliseconds spent in each phase on the scheduler thread:

- ``idle``: blocked on the scheduler's inbox (nothing to do until a step, a request or a cancel came);
- ``build``: building the step's lazy graph (inputs, the forward, the sampling ops) and queueing it;
- ``device``: waiting for the device (``mx.eval`` / reading the sampled ids: the device's share of a
  synchronous step, the rest of it after the host work overlapped it in an asynchronous one);
- ``sample``: turning the sampled ids (and log-probabilities) into ``Sampled`` rows on the host;
- ``detok``: detokenization and stop strings (``SequenceText.feed``/``finish``) on this thread;
- ``emit``: handing events to the HTTP side (``EventStream.push``; with the emitter thread, its queue);
- ``lock``: waiting for the scheduler's admission lock;
- ``other``: the rest (planning, bookkeeping, the interpreter).

``off_detok`` and ``off_emit`` are the emitter thread's detokenization and delivery during the pass
(asynchronous scheduling moves them off this thread): not parts of its wall time.

``bench/step_trace.py`` summarises a file: each phase's share of the wall time, rows per step.
The recorder costs two ``perf_counter`` calls per phase when on and one attribute test when off.
"""

from __future__ import annotations

import atexit
import json
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from mlxcel import envs

FLUSH_S = 0.25  # lines reach the file at least this often
PHASES = ("idle", "build", "device", "sample", "detok", "emit", "lock")
OFF_PHASES = ("off_detok", "off_emit")  # on the emitter thread (mlxcel/engine/emitter.py), beside the passes


class StepTrace:
    """Accumulates one scheduler pass's phases and writes it as a JSONL line."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = self.path.open("a", buffering=1 << 16)
        self._t0 = self._flushed = time.perf_counter()
        atexit.register(self.close)  # a server stopped by a signal still leaves whole lines
        self._lock = threading.Lock()  # phases may be added from the emitter thread too
        self._reset(time.perf_counter())

    def _reset(self, now: float) -> None:
        self._start = now
        self._ms: dict[str, float] = dict.fromkeys(PHASES + OFF_PHASES, 0.0)
        self._steps: list[list[Any]] = []  # [event, kind, rows]

    def add(self, phase: str, seconds: float) -> None:
        with self._lock:
            self._ms[phase] = self._ms.get(phase, 0.0) + seconds * 1000.0

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start)

    def step(self, event: str, kind: str, rows: int) -> None:
        """Note a step ``submitted`` or ``applied`` in this pass."""
        self._steps.append([event, kind, rows])

    def end_pass(self, **fields: Any) -> None:
        """Close the pass: write it (when it touched a step) and start the next."""
        now = time.perf_counter()
        with self._lock:
            ms, steps = self._ms, self._steps
            if steps and not self._fh.closed:
                wall = (now - self._start) * 1000.0
                known = sum(ms[p] for p in PHASES)
                line = {"t": round(self._start - self._t0, 6), "wall_ms": round(wall, 4),
                        "submitted": [s[1:] for s in steps if s[0] == "submitted"],
                        "applied": [s[1:] for s in steps if s[0] == "applied"],
                        **{k: round(v, 4) for k, v in ms.items()}, "other": round(max(0.0, wall - known), 4),
                        **fields}
                self._fh.write(json.dumps(line) + "\n")
                if now - self._flushed >= FLUSH_S:
                    self._fh.flush()
                    self._flushed = now
                self._reset(now)
            # else: a pass that touched no step (an idle wait alone) folds into the next line's idle time

    def discard(self) -> None:
        """Drop what was accumulated since the last line (warmup is not traffic)."""
        with self._lock:
            self._reset(time.perf_counter())

    def close(self) -> None:
        with self._lock:
            if not self._fh.closed:
                self._fh.close()


_active: StepTrace | None = None


def from_env() -> StepTrace | None:
    """The trace ``MLXCEL_STEP_TRACE`` names (one per process, opened on first use), else the one
    ``install`` set, else None."""
    global _active
    path = envs.settings().step_trace
    if path and _active is None:
        _active = StepTrace(path)
    return _active


def install(trace: StepTrace | None) -> None:
    """Make ``trace`` the process's trace (None: tracing off); for tests and tools."""
    global _active
    _active = trace


def active() -> StepTrace | None:
    """The open trace, if any (for the executor and sampling code the scheduler calls)."""
    return _active


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Time a block into the active trace's phase ``name``; nothing when tracing is off."""
    trace = _active
    if trace is None:
        yield
        return
    with trace.phase(name):
        yield
