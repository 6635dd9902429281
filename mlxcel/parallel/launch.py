"""Starting a tensor-parallel group: addresses, local follower processes, ``mx.distributed.init``.

Without a hostfile rank 0 starts ranks 1..N-1 on this host (``python -m mlxcel.parallel.follower``),
every ring port on 127.0.0.1; the cluster secret (the configured one, else a fresh random one for
this launch) reaches each child on its stdin, never on a command line. With a hostfile each rank is
started by the operator (``mlxcel-server --tp-hostfile F --tp-rank R``).

``mx.distributed.init`` blocks until every rank joined (it has no timeout of its own), so it runs on a
helper thread under a deadline; a rank that never comes is one error line, not a hang.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlxcel.config import TP_MIN_JOIN_S, TP_STOP_GRACE_S
from mlxcel.parallel.errors import TPError
from mlxcel.parallel.hostfile import Hostfile
from mlxcel.parallel.options import TPOptions

LOOPBACK = "127.0.0.1"
NCCL_PORT_OFFSET = 0  # NCCL's rendezvous port is the first ring port
WORKDIR_PREFIX = "mlxcel-tp-"  # then the PID: a dir whose process is gone is removed by the next rank


def join_seconds(timeout: float) -> float:
    return max(TP_MIN_JOIN_S, 4 * timeout)


def resolve_backend(requested: str, hostfile: Hostfile | None) -> str:
    """auto -> the hostfile's backend, else nccl where MLX has CUDA, else ring; checked against this MLX."""
    import mlx.core as mx

    backend = requested
    if backend == "auto":
        named = hostfile.backend if hostfile is not None else ""
        cuda = getattr(mx, "cuda", None)
        if named:
            backend = named
        elif cuda is not None and cuda.is_available() and mx.distributed.is_available("nccl"):
            backend = "nccl"
        else:
            backend = "ring"
    if backend not in ("ring", "nccl", "jaccl"):
        raise TPError(f"tensor-parallel backend {backend!r} is not one of ring, nccl, jaccl")
    if not mx.distributed.is_available(backend):
        raise TPError(f"--tp-backend {backend} is not available in this MLX build "
                      "(nccl needs mlx-cuda and NVIDIA GPUs, jaccl macOS with Thunderbolt RDMA)")
    return backend


#: where a local group's ring ports come from: below the kernel's ephemeral range (ip_local_port_range), so no
#: outgoing connection of this host takes one between the check and the ranks' bind
LOCAL_PORTS = (10_000, 20_000)  # tests/ports.py hands out 20000-32000
PORT_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_ports(n: int, host: str = LOOPBACK, *, attempts: int = 200) -> list[int]:
    """``n`` distinct ports free on ``host`` right now (held open together so they differ), drawn below the
    ephemeral range where it is known (``LOCAL_PORTS``); ports the kernel picks where none of those is free."""
    low, high = LOCAL_PORTS
    socks: list[socket.socket] = []
    try:
        for port in _candidates(low, min(high, _ephemeral_floor()), attempts):
            if len(socks) == n:
                break
            s = socket.socket()
            try:
                s.bind((host, port))
                socks.append(s)
            except OSError:
                s.close()
        while len(socks) < n:  # the low range is taken (or absent): the kernel's choice, as before
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _ephemeral_floor() -> int:
    """The lowest port the kernel hands out on its own (32768 when unknown)."""
    try:
        return int(PORT_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def _candidates(low: int, high: int, count: int) -> list[int]:
    """Up to ``count`` distinct random ports in ``[low, high)``."""
    if high <= low:
        return []
    rng = secrets.SystemRandom()
    return rng.sample(range(low, high), min(count, high - low))


@dataclass
class GroupSpec:
    """What every rank needs to join: backend, rank count, ring addresses (or NCCL rendezvous)."""

    backend: str
    size: int
    ring: list[list[str]] = field(default_factory=list)
    nccl_host: str = LOOPBACK
    nccl_port: int = 0

    def to_json(self) -> str:
        return json.dumps({"backend": self.backend, "size": self.size, "ring": self.ring,
                           "nccl_host": self.nccl_host, "nccl_port": self.nccl_port})

    @classmethod
    def from_json(cls, text: str) -> "GroupSpec":
        d = json.loads(text)
        return cls(str(d["backend"]), int(d["size"]), [list(map(str, n)) for n in d["ring"]],
                   str(d["nccl_host"]), int(d["nccl_port"]))


def group_spec(tp: TPOptions, backend: str) -> tuple[GroupSpec, tuple[str, int]]:
    """The group's addresses and rank 0's control address, from the hostfile or free loopback ports."""
    if tp.hostfile is not None:
        assert tp.port is not None
        ring = tp.hostfile.ring_addresses(tp.port)
        spec = GroupSpec(backend, tp.size, ring, tp.hostfile.ips[0][0], tp.port + NCCL_PORT_OFFSET)
        return spec, tp.hostfile.control_address(tp.port)
    control_port = tp.port + tp.size if tp.port is not None else 0
    return local_group_spec(tp.size, backend, tp.port), (LOOPBACK, control_port)


def local_group_spec(size: int, backend: str, first_port: int | None = None) -> GroupSpec:
    """``size`` ranks on 127.0.0.1: ports from ``first_port`` on, else free ones."""
    ports = list(range(first_port, first_port + size)) if first_port is not None else free_ports(size)
    return GroupSpec(backend, size, [[f"{LOOPBACK}:{p}"] for p in ports], LOOPBACK, ports[0])


def group_environment(spec: GroupSpec, rank: int, workdir: Path) -> dict[str, str]:
    """The environment MLX reads in ``mx.distributed.init`` for ``rank`` (the ring's MLX_HOSTFILE is written)."""
    env = {"MLX_RANK": str(rank), "MLX_WORLD_SIZE": str(spec.size)}
    if spec.backend == "ring":
        path = workdir / f"ring-{rank}.json"
        path.write_text(json.dumps(spec.ring))
        env["MLX_HOSTFILE"] = str(path)
    elif spec.backend == "nccl":
        env.update(NCCL_HOST_IP=spec.nccl_host, NCCL_PORT=str(spec.nccl_port))
    return env


def init_group(spec: GroupSpec, rank: int, deadline_s: float) -> Any:
    """``mx.distributed.init`` for this rank within ``deadline_s`` seconds, else TPError."""
    _remove_stale_workdirs()
    with tempfile.TemporaryDirectory(prefix=f"{WORKDIR_PREFIX}{os.getpid()}-") as workdir:  # read during init only
        os.environ.update(group_environment(spec, rank, Path(workdir)))
        return _init(spec, rank, deadline_s)


def _remove_stale_workdirs() -> None:
    """Work dirs left by ranks that exited during ``init`` (a process killed there runs no cleanup)."""
    for path in Path(tempfile.gettempdir()).glob(f"{WORKDIR_PREFIX}*-*"):
        pid = path.name[len(WORKDIR_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and path.is_dir() and path.stat().st_uid == os.getuid() and not _alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _init(spec: GroupSpec, rank: int, deadline_s: float) -> Any:
    import mlx.core as mx

    result: dict[str, Any] = {}

    def init() -> None:
        try:
            result["group"] = mx.distributed.init(strict=True, backend=spec.backend)
        except Exception as exc:  # noqa: BLE001 - reported below
            result["error"] = exc

    t = threading.Thread(target=init, name="mlxcel-tp-init", daemon=True)
    t.start()
    t.join(deadline_s)
    if "error" in result:
        raise TPError(f"tensor-parallel rank {rank}: {spec.backend} group failed to start: {result['error']}")
    if "group" not in result:
        raise TPError(f"tensor-parallel rank {rank}: the {spec.backend} group did not form within {deadline_s:g}s "
                      "(a rank never joined)")
    group = result["group"]
    if group.size() != spec.size or group.rank() != rank:
        raise TPError(f"the {spec.backend} group is rank {group.rank()} of {group.size()}, expected {rank} of {spec.size}")
    return group


class LocalRanks:
    """Follower processes of this host, started by rank 0 and stopped by it (by PID)."""

    def __init__(self) -> None:
        self.procs: dict[int, subprocess.Popen] = {}

    def spawn(self, rank: int, argv: list[str], secret: bytes, env: dict[str, str]) -> None:
        cmd = [sys.executable, "-m", "mlxcel.parallel.follower", *argv]
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, env={**os.environ, **env}, start_new_session=False)
        assert proc.stdin is not None
        proc.stdin.write(secret.hex().encode() + b"\n")
        proc.stdin.close()
        self.procs[rank] = proc

    def problem(self) -> str | None:
        """A line naming the first follower that exited, or None while all run."""
        for rank, proc in sorted(self.procs.items()):
            code = proc.poll()
            if code is not None:
                how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
                return f"tensor-parallel rank {rank} (pid {proc.pid}) {how}"
        return None

    def stop(self, grace: float = TP_STOP_GRACE_S) -> None:
        """Wait up to ``grace`` s for the followers to leave, then SIGKILL the rest."""
        deadline = time.monotonic() + grace
        for proc in self.procs.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGKILL)
                proc.wait()


def launch_secret(configured: Any) -> bytes:
    """The secret bytes local followers get: the configured cluster secret, else a fresh one for this launch."""
    return configured.reveal() if configured is not None else secrets.token_bytes(32)
