"""Real ``mlxcel serve`` processes for the bring-up tests: peers and coordinators on 127.0.0.x.

Every process gets its own working directory (so the default ``.mlxcel/`` outputs land there),
``--port 0`` for HTTP and ``--log-level info``; stderr is kept in ``lines``. Beacons always go to
127.0.0.1 (never a broadcast address: the tests stay on this machine).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.ports import free_port  # noqa: F401  (re-exported to the cluster tests)
from tests.server.util import stop_process

CLI = [sys.executable, "-m", "mlxcel", "serve"]
COORDINATOR_HOST = "127.0.0.2"
_HTTP = re.compile(r"(?:serving \S+ on |health on )(http://[\d.]+:\d+)")
_WAITING = re.compile(r"waiting for a stage assignment on (\S+) ")


def write_secret(path: Path) -> Path:
    path.write_text(os.urandom(32).hex() + "\n")
    path.chmod(0o600)
    return path


def _sigint_as_from_a_terminal() -> None:
    """In the child before exec: SIGINT's default disposition, so its Python raises KeyboardInterrupt on it even
    when the suite runs in the background (a non-interactive shell starts background jobs with SIGINT ignored,
    an ignored signal stays ignored across exec, and the signal tests would then see no interrupt at all)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Proc:
    """One server process; ``wait_for(regex)`` searches its stderr as it arrives."""

    def __init__(self, name: str, cwd: Path, *argv: str, env: dict | None = None):
        self.name, self.cwd = name, cwd
        self.argv, self.env = argv, env
        cwd.mkdir(parents=True, exist_ok=True)
        cmd = [*CLI, "--port", "0", "--served-model-name", "tiny", "--log-level", "info", *argv]
        self.proc = subprocess.Popen(cmd, cwd=cwd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                                     env={**os.environ, **(env or {})}, preexec_fn=_sigint_as_from_a_terminal)
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._done = False
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with self._changed:
                self.lines.append(line)
                self._changed.notify_all()
        with self._changed:
            self._done = True
            self._changed.notify_all()

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, timeout: float = 60) -> re.Match:
        """The first match of ``pattern`` in stderr; fails when the process ends or time runs out."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                m = regex.search(self.text)
                if m:
                    return m
                left = deadline - time.monotonic()
                if self._done or left <= 0:
                    why = "exited" if self._done else f"no match within {timeout:g}s"
                    raise AssertionError(f"{self.name}: {why} for {pattern!r}:\n{self.text}")
                self._changed.wait(min(left, 0.5))

    @property
    def url(self) -> str:
        return self.wait_for(_HTTP.pattern).group(1)

    @property
    def listener(self) -> str:
        """A peer's assignment listener address, from its waiting line."""
        return self.wait_for(_WAITING.pattern).group(1)

    def wait_exit(self, timeout: float = 60) -> int:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name} still running after {timeout:g}s:\n{self.text}") from None
        with self._changed:
            while not self._done:
                self._changed.wait(1)
        return code

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, sig: int = signal.SIGINT) -> int:
        return stop_process(self.proc, sig)


class Bringup:
    """Starts peers and coordinators of one test and stops every one of them at the end."""

    def __init__(self, tmp: Path, model: Path):
        self.tmp, self.model = tmp, model
        self.secret = write_secret(tmp / "cluster.secret")
        self.procs: list[Proc] = []

    def peer(self, name: str, host: str | None = None, *flags: str, model: Path | None = None,
             secret: Path | None = None, port: int | None = None, env: dict | None = None) -> Proc:
        """A --pp-peer; ``host`` given: static discovery on host:port (a free port unless given)."""
        argv = ["-m", str(model or self.model), "--pp-peer", "--cluster-secret-file", str(secret or self.secret)]
        if host is not None:
            argv += ["--host", host, "--cluster-control-addr", f"{host}:{port or free_port(host)}"]
        proc = Proc(name, self.tmp / name, *argv, *flags, env=env)
        self.procs.append(proc)
        proc.listener  # noqa: B018 - waits until it listens
        return proc

    def coordinator(self, name: str, stages: int, *flags: str, secret: Path | None = None,
                    control_port: int | None = None) -> Proc:
        port = control_port or free_port(COORDINATOR_HOST)
        argv = ["-m", str(self.model), "--pp-auto", str(stages), "--host", COORDINATOR_HOST,
                "--cluster-control-addr", f"{COORDINATOR_HOST}:{port}",
                "--cluster-secret-file", str(secret or self.secret)]
        proc = Proc(name, self.tmp / name, *argv, *flags)
        self.procs.append(proc)
        return proc

    def restart(self, proc: Proc) -> Proc:
        """``proc``'s command started again in its directory, as a supervisor does after it died."""
        again = Proc(proc.name, proc.cwd, *proc.argv, env=proc.env)
        self.procs.append(again)
        return again

    def node(self, name: str, toml: Path, node_id: str, host: str, *flags: str) -> Proc:
        """A process started from a generated TOML (``--distributed-config``), no secret flag."""
        proc = Proc(name, self.tmp / name, "-m", str(self.model), "--distributed-config", str(toml),
                    "--node-id", node_id, "--host", host, *flags)
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()
