"""``mlxcel node supervise --config FILE``: run one node as a child and restart it when it dies.

``mlxcel node start`` runs this in a session of its own, with its output appended to the node's log;
the node runs as its child in another session (so ``mlxcel node stop`` can signal the node's whole
process group) with its pid in the pidfile, as before. On each death the supervisor logs the cause
(``exit N`` or ``signal NAME``), decides with ``mlxcel/node/restart.py`` whether and when to restart,
and records everything in ``<pidfile>.state`` (``mlxcel/node/state.py``), which ``mlxcel node
status`` and ``status.yml`` show. A node that ends on its first run before it was ever ready is a
failed start, not a crash: the supervisor gives up at once, and ``mlxcel node start`` fails with the
log's last lines as it did without a supervisor.

SIGTERM or SIGINT to the supervisor stops the node (SIGTERM to its session, SIGKILL after
``stop_grace_s``) and then the supervisor; ``mlxcel node stop`` does exactly that.

Once an ``mlxcel-server`` node is ready, the supervisor also starts its standby (``[restart]
standby``, on by default; ``mlxcel/commands/standby.py``): the same command line, which imports what
a start needs and waits. A restart hands over to it (one byte on a pipe), so the restarted node skips
its imports; a new standby follows once that node is ready. The standby ends with the supervisor.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from types import FrameType

from mlxcel.node import supervisor
from mlxcel.node.restart import Backoff, exit_cause, no_restart_because
from mlxcel.node.spec import NodeSpec
from mlxcel.node.state import SupervisorState, utc_now

WATCH_S = 0.05  # how often the supervisor looks at its child (its exit is seen within this)
PROBE_EVERY_S = 0.2  # the readiness URL is probed this often until it first answers 200


class Standby:
    """A warm copy of the node's command line, waiting on a pipe (``spawn_standby``)."""

    def __init__(self, spec: NodeSpec):
        self.proc, self._go, self._warm_pipe = supervisor.spawn_standby(spec)
        self.warm = False

    def became_warm(self) -> bool:
        """True once, when it reports its imports done."""
        if self.warm:
            return False
        try:
            self.warm = os.read(self._warm_pipe, 1) == b"w"
        except BlockingIOError:
            return False
        return self.warm

    def alive(self) -> bool:
        return self.proc.poll() is None

    def activate(self) -> bool:
        """Tell it to become the node; False when it cannot (it died)."""
        try:
            os.write(self._go, b"g")
        except OSError:
            return False
        finally:
            self._close()
        return self.alive()

    def discard(self) -> None:
        """End it: a closed pipe makes it exit 0; SIGKILL if it does not within a second."""
        self._close()
        try:
            self.proc.wait(1.0)
        except subprocess.TimeoutExpired:
            supervisor.signal_session(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def _close(self) -> None:
        for fd in (self._go, self._warm_pipe):
            try:
                os.close(fd)
            except OSError:
                pass
        self._go = self._warm_pipe = -1


class Supervisor:
    """The supervising loop of one node."""

    def __init__(self, spec: NodeSpec):
        self.spec = spec
        self.stopping = False
        self.backoff = Backoff(spec.restart)
        self.state = SupervisorState(supervisor_pid=os.getpid())
        self.died_at: float | None = None  # monotonic time of the last death, until the node is ready again
        self.standby: Standby | None = None

    def run(self) -> int:
        """Supervise until the node ends for good or the supervisor is told to stop; the exit status."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._stop)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        try:
            return self._supervise()
        finally:
            if self.standby is not None:
                self.standby.discard()

    def _supervise(self) -> int:
        first = True
        while not self.stopping:
            proc = self._spawn()
            if proc is None:
                return 1
            began = time.monotonic()
            returncode, ready = self._watch(proc)
            if returncode is None:  # told to stop
                return self._stop_node(proc)
            ran = time.monotonic() - began
            self.spec.pidfile.unlink(missing_ok=True)
            if not self._restart_after(returncode, ran, first_and_never_ready=first and not ready):
                if self.stopping:  # told to stop during the backoff
                    self._record("stopped", f"{self.spec.name} not restarted: its supervisor was told to stop")
                    return 0
                return 0 if returncode == 0 else 1
            first = False
        self._record("stopped", f"{self.spec.name} not restarted: its supervisor was told to stop")
        return 0

    def _stop(self, signum: int, frame: FrameType | None) -> None:
        self.stopping = True

    # -- one run ----------------------------------------------------------------------------------------

    def _spawn(self) -> subprocess.Popen | None:
        standby, self.standby = self.standby, None
        if standby is not None and standby.activate():
            supervisor.record_started(self.spec, standby.proc.pid)
            self.state.pid, self.state.standby_pid, self.state.standby_warm = standby.proc.pid, None, False
            self._record("starting", f"{self.spec.name} restarted (restart {self.state.restarts}) from its "
                                     f"{'warm' if standby.warm else 'still warming'} standby, pid {standby.proc.pid}")
            return standby.proc
        if standby is not None:
            standby.discard()
        try:
            proc = supervisor.spawn_node(self.spec)
        except OSError as exc:
            self._record("failed", f"{self.spec.name}: cannot run {self.spec.command[0]}: {exc.strerror or exc}")
            return None
        self.state.pid = proc.pid
        what = "started" if self.state.restarts == 0 else f"restarted (restart {self.state.restarts})"
        self._record("starting" if self.spec.ready_url else "running", f"{self.spec.name} {what}, pid {proc.pid}",
                     log=self.state.restarts > 0)
        return proc

    def _watch(self, proc: subprocess.Popen) -> tuple[int | None, bool]:
        """Wait for the child's exit (its return code) or a stop (None); whether it got ready meanwhile."""
        ready = self.spec.ready_url is None
        next_probe = time.monotonic()
        while not self.stopping:
            returncode = proc.poll()
            if returncode is not None:
                return returncode, ready
            self._watch_standby()
            if not ready and time.monotonic() >= next_probe:
                ready = supervisor.probe(self.spec.ready_url)[0] == 200
                next_probe = time.monotonic() + PROBE_EVERY_S
                if ready:
                    self._ready()
            time.sleep(WATCH_S)
        return None, ready

    def _watch_standby(self) -> None:
        standby = self.standby
        if standby is None:
            return
        if not standby.alive():
            self.standby = None
            self.state.standby_pid, self.state.standby_warm = None, False
            self._record(self.state.state, f"{self.spec.name}: its standby ended "
                                           f"({exit_cause(standby.proc.returncode)}); the next restart starts cold")
            standby.discard()
        elif standby.became_warm():
            self.state.standby_warm = True
            self._record(self.state.state, f"{self.spec.name}: standby pid {standby.proc.pid} warm", log=False)

    def _start_standby(self) -> None:
        if self.standby is not None or not supervisor.wants_standby(self.spec):
            return
        try:
            self.standby = Standby(self.spec)
        except OSError as exc:
            self._record(self.state.state, f"{self.spec.name}: no standby ({exc.strerror or exc})")
            return
        self.state.standby_pid, self.state.standby_warm = self.standby.proc.pid, False

    def _ready(self) -> None:
        self._start_standby()
        if self.died_at is None:
            self._record("running", f"{self.spec.name} ready, pid {self.state.pid}", log=False)
            return
        healed = time.monotonic() - self.died_at
        self.died_at = None
        self.state.last_heal_s = round(healed, 2)
        self._record("running", f"{self.spec.name} ready again {healed:.1f} s after it ended "
                                f"({self.state.last_cause}; restart {self.state.restarts})")

    def _restart_after(self, returncode: int, ran_s: float, *, first_and_never_ready: bool) -> bool:
        """Record the death; True after the backoff when the node is to be restarted."""
        cause = exit_cause(returncode)
        self.state.pid = None
        self.died_at = time.monotonic() if self.died_at is None else self.died_at
        self.state.last_cause, self.state.last_exit = cause, utc_now()
        name = self.spec.name
        final = no_restart_because(returncode, self.spec.restart)
        if final is None and first_and_never_ready:
            final = "it ended during start-up, before it was ever ready (a failed start, not a crash)"
        if final is not None:
            state = "exited" if returncode == 0 else "failed"
            self._record(state, f"{name} ended ({cause}) after {ran_s:.1f} s; not restarted: {final}")
            return False
        delay = self.backoff.next_delay(ran_s)
        if delay is None:
            policy = self.spec.restart
            self._record("crash-loop", f"{name} ended ({cause}) after {ran_s:.1f} s: crash loop, {policy.limit} restarts "
                                       f"in a row, none of which ran {policy.reset_s:g} s; giving up (mlxcel node start "
                                       f"starts it again)")
            return False
        self.state.restarts += 1
        self._record("restarting", f"{name} ended ({cause}) after {ran_s:.1f} s; restart {self.state.restarts} "
                                   f"in {delay:g} s")
        deadline = time.monotonic() + delay
        while not self.stopping and time.monotonic() < deadline:
            time.sleep(min(WATCH_S, max(0.0, deadline - time.monotonic())))
        return not self.stopping

    def _stop_node(self, proc: subprocess.Popen) -> int:
        """SIGTERM to the node's session, SIGKILL after the grace; then the pidfile goes."""
        supervisor.signal_session(proc.pid, signal.SIGTERM)
        try:
            proc.wait(self.spec.stop_grace_s)
            killed = False
        except subprocess.TimeoutExpired:
            supervisor.signal_session(proc.pid, signal.SIGKILL)
            proc.wait()
            killed = True
        self.spec.pidfile.unlink(missing_ok=True)
        self.state.pid, self.state.killed = None, killed
        how = f"killed (SIGKILL after {self.spec.stop_grace_s:g} s)" if killed else "stopped"
        self._record("stopped", f"{self.spec.name} {how} by its supervisor")
        return 0

    # -- the record -------------------------------------------------------------------------------------

    def _record(self, state: str, message: str, *, log: bool = True) -> None:
        """Update ``<pidfile>.state``; ``log``: also append the message to the node's log (our stdout), first, so
        that whoever reads the new state finds its line in the log."""
        if log:
            print(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} mlxcel node supervise: {message}", flush=True)
        self.state.state, self.state.message = state, message
        self.state.write(self.spec.state_file)


def supervise(spec: NodeSpec) -> int:
    """Run the node under a supervisor in this process until it ends for good or is stopped."""
    return Supervisor(spec).run()
