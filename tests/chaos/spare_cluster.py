"""A --pp-auto pipeline of 2 stages and 1 spare, as chaos targets (docs/bringup.md §5.6).

Three ``--pp-peer`` processes on 127.0.0.3-.5 and a ``--pp-auto 2 --pp-spare 1`` coordinator. The
target ``stage-i`` is whichever process the coordinator's ``/health`` names for that stage now. A
killed stage is left dead while the spare is unused (the spare takes it over); after that, a killed
or stopped stage is started again from its own cluster TOML at the same address, as a supervisor
would. A process restarted after a spare took its stage is not a member any more and is stopped.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx

from tests.bringup.procs import Bringup, Proc
from tests.chaos.harness import Target

HOSTS = ("127.0.0.3", "127.0.0.4", "127.0.0.5")  # address order: two stages, then the spare


class SpareCluster:
    def __init__(self, tmp: Path, model: Path, *, spare_after_s: float = 5.0) -> None:
        self.bringup = Bringup(tmp, model)
        self.spare_after_s = spare_after_s
        self.members: dict[str, tuple[Proc, Path]] = {}  # listener address -> (process, its cluster TOML)
        self.spare: Proc | None = None
        self._killed: set[int] = set()
        self._runs = 0

    def start(self) -> "SpareCluster":
        peers = [self.bringup.peer(f"peer-{h}", h, "--no-warmup") for h in HOSTS]
        self.coordinator = self.bringup.coordinator(
            "coord", 2, "--pp-spare", "1", "--pp-spare-after", f"{self.spare_after_s:g}", "--no-warmup",
            "--parallel", "4", "--cluster-peers", ",".join(p.listener for p in peers))
        self.coordinator.wait_for(r"model tiny ready", 240)
        self.url = self.coordinator.url
        for i, proc in enumerate(peers[:2]):
            self.members[proc.listener] = (proc, proc.cwd / ".mlxcel" / f"cluster-stage-{i}.toml")
        self.spare = peers[2]
        return self

    def stop(self) -> None:
        self.bringup.stop()

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=5).json()

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    def address(self, i: int) -> str:
        return next(s["address"] for s in self.health()["stages"] if s["id"] == f"stage-{i}")

    def current(self, i: int) -> Proc:
        return self.members[self.address(i)][0]

    def targets(self) -> list[Target]:
        return [Target(f"stage-{i}", pid=lambda i=i: self.current(i).proc.pid, start=lambda i=i: self._start(i),
                       stop=lambda sig, i=i: self._stop(i, sig)) for i in range(2)]

    def _stop(self, i: int, sig: int) -> None:
        self.current(i).stop(sig)
        if sig == signal.SIGKILL:
            self._killed.add(i)

    def _start(self, i: int, timeout: float = 240.0) -> None:
        killed = i in self._killed
        self._killed.discard(i)
        if killed and self.spare is not None:
            self._taken_over(i, timeout)
            return
        old = self.address(i)
        proc, toml = self.members[old]
        self._runs += 1
        again = self.bringup.node(f"stage-{i}-run-{self._runs}", toml, f"stage-{i}", old.rsplit(":", 1)[0],
                                  "--no-warmup")
        again.wait_for(r"serving layers", timeout)
        self.members[old] = (again, toml)
        if self.spare is not None and self._takeover_started(timeout) and self._moved_to_spare(i, timeout):
            again.stop()  # the spare took the stage while it restarted: this process is no member now

    def _takeover_started(self, timeout: float) -> bool:
        """After a restart: True once the spare is being assigned, False once the cluster is whole again."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                body = self.health()
            except (httpx.TransportError, ValueError):
                body = {}
            if body.get("spares", [{}])[0].get("state", "standby") != "standby":
                return True
            if body.get("status") == "ready":
                return False
            time.sleep(0.2)
        return False

    def _taken_over(self, i: int, timeout: float) -> None:
        """Leave the stage dead: wait until the coordinator names the spare for it."""
        assert self.spare is not None
        if not self._moved_to_spare(i, timeout):
            raise RuntimeError(f"the spare did not take over stage-{i} within {timeout:g}s")

    def _moved_to_spare(self, i: int, timeout: float) -> bool:
        """Whether the coordinator names the spare for stage ``i`` within ``timeout`` (then it is a member)."""
        assert self.spare is not None
        spare, deadline = self.spare.listener, time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if self.address(i) == spare:
                    self.spare.wait_for(r"serving layers", timeout)
                    toml = self.spare.cwd / ".mlxcel" / f"cluster-stage-{i}.toml"
                    self.members[spare] = (self.spare, toml)
                    self.spare = None
                    return True
            except (httpx.TransportError, StopIteration, ValueError):
                pass
            time.sleep(0.2)
        return False
