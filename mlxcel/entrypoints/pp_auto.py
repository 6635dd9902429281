"""Role ``pp-auto``: find the peers, plan the cluster, assign every stage, then be the coordinator.

After a successful push this process is the ``coordinator`` node of the cluster TOML it wrote
(``--cluster-config-out``): the role table picks that role for it, exactly as for
``--distributed-config <that file> --node-id coordinator``. With ``--dry-run`` it plans, writes the
file and exits without assigning anything.
"""

from __future__ import annotations

import logging
import signal
import socket
import sys
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from mlxcel import __version__
from mlxcel.cluster.identity import PeerId
from mlxcel.cluster.secret import ClusterSecret
from mlxcel.cluster.sockets import family
from mlxcel.errors import CLIError
from mlxcel.process import STOP_REQUESTED
from mlxcel.topology.partition import PartitionError, format_range, layer_costs
from mlxcel.entrypoints.context import RoleContext, ServeConfig
from mlxcel.topology.distributed import from_toml

from mlxcel.bringup.beacon import BeaconListener, BeaconVerifier
from mlxcel.bringup.errors import BringupError
from mlxcel.bringup.flags import BringupSettings, bringup_settings, check_reachable
from mlxcel.bringup.plan import ClusterPlan, coordinator_header, write_file
from mlxcel.bringup.push import Push, PushConfig
from mlxcel.bringup.spares import SparePool
from mlxcel.bringup.wire import COORDINATOR_NODE_ID, DISCOVERY_SETTLE_S, DISCOVERY_WINDOW_S

if TYPE_CHECKING:
    from mlxcel.entrypoints.flags import ServeFlags

log = logging.getLogger("mlxcel.entrypoints.pp_auto")

EXIT_INTERRUPTED = 130  # as the CLI's for SIGINT


def _say(text: str) -> None:
    print(f"mlxcel: pp-auto: {text}", file=sys.stderr, flush=True)


def discover(settings: BringupSettings, secret: ClusterSecret, *,
             window_s: float = DISCOVERY_WINDOW_S) -> list[PeerId]:
    """The peers whose beacons verify within the discovery window; ``CLIError`` unless exactly N (+ spares)."""
    n = settings.peer_count
    verifier = BeaconVerifier(secret, mlxcel=__version__, cluster=settings.cluster)
    try:
        listener = BeaconListener(verifier, settings.discovery_port)
    except OSError as exc:
        raise CLIError(f"cannot listen for beacons on UDP port {settings.discovery_port}: "
                       f"{exc.strerror or exc}") from None
    _say(f"listening for {n} peer beacons on UDP port {listener.port} for up to {window_s:g}s")
    try:
        peers = listener.collect(n, window_s, settle_s=DISCOVERY_SETTLE_S)
    finally:
        listener.close()
    found = ", ".join(map(str, peers)) or "none"
    if len(peers) < n:
        raise CLIError(f"discovery found {len(peers)} of {n} peers within {window_s:g}s ({found}): peers must be "
                       f"beaconing (--pp-peer --cluster-discovery=mdns, same --cluster-name, secret and "
                       f"--cluster-discovery-port) when the coordinator starts or within its window")
    if len(peers) > n:
        spares = f" with --pp-spare {settings.spares}" if settings.spares else ""
        raise CLIError(f"discovery found {len(peers)} peers for --pp-auto {settings.stages}{spares} ({found}): stop the extra peers, "
                       "give them another --cluster-name, or list the peers with --cluster-peers")
    check_reachable(settings.control, peers)
    return peers


def _describe(plan: ClusterPlan) -> str:
    return ", ".join(f"{s.node_id} = {s.address} (layers {format_range(s.start, s.end)})" for s in plan.stages)


def check_control_address(control: PeerId) -> None:
    """Bind the control address once before assigning anything: a taken or foreign address fails
    now, not after the stages were started."""
    sock = socket.socket(family(control.host), socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(control.address)
        sock.listen(1)
    except OSError as exc:
        raise CLIError(f"cannot listen on the cluster address {control}: {exc.strerror or exc}") from None
    finally:
        sock.close()


def push(model: Path, settings: BringupSettings, secret: ClusterSecret) -> tuple[ClusterPlan, SparePool | None]:
    """Discover (mdns) or take the listed peers (static), then run the push; ``CLIError`` on failure.
    Returns the plan and (None under ``--dry-run``) the pool that re-assigns a stage's restarted peer and
    holds the spares told to stand by (with ``--pp-spare``)."""
    from mlxcel.models.identity import model_identity

    try:
        costs = layer_costs(model)
    except PartitionError as exc:
        raise CLIError(str(exc)) from None
    if not settings.dry_run:
        check_control_address(settings.control)
    peers = discover(settings, secret) if settings.discovery == "mdns" else list(settings.peers)
    path = settings.config_path()
    config = PushConfig(control=settings.control, cluster=settings.cluster, mlxcel=__version__,
                        model_identity=model_identity(model), costs=costs, secret_file=secret.path,
                        dry_run=settings.dry_run)

    def write_plan(plan: ClusterPlan) -> None:
        write_file(path, coordinator_header(plan, __version__) + plan.body())

    what = "planning" if settings.dry_run else "assigning"
    spares = f" (and {settings.spares} spare{'s' if settings.spares != 1 else ''})" if settings.spares else ""
    _say(f"{what} {settings.stages} stages{spares} of cluster {settings.cluster!r} over "
         f"{', '.join(map(str, peers))} from control address {settings.control}")
    attempt = Push(config, secret, peers, write_plan=write_plan, stages=settings.stages)
    started = time.monotonic()
    try:
        plan = attempt.run()
    except BringupError as exc:
        raise CLIError(str(exc)) from None
    wire = attempt.wire()
    _say(f"push over {len(peers)} peers took {time.monotonic() - started:.3f}s; assignment channel: sent "
         f"{wire.sent_frames} frames {wire.sent_bytes} bytes, received {wire.received_frames} frames "
         f"{wire.received_bytes} bytes")
    if settings.dry_run:
        return plan, None
    pool = SparePool(config, secret, plan, attempt.spares, write_plan=write_plan, after_s=settings.spare_after_s)
    if settings.spares:
        pool.start()
        _say(f"spares standing by: {', '.join(map(str, attempt.spares)) or 'none'}; a stage down for "
             f"{settings.spare_after_s:g}s is assigned to one")
    return plan, pool


def _interrupt(signum: int, frame: Any) -> None:
    STOP_REQUESTED.set()  # kept for the coordinator role's server, should the exception below be dropped
    raise KeyboardInterrupt


@contextmanager
def signals_interrupt() -> Iterator[None]:
    """SIGINT and SIGTERM raise ``KeyboardInterrupt`` instead of killing the process, and are remembered
    (``STOP_REQUESTED``); the coordinator role's server installs its own handlers while it serves."""
    STOP_REQUESTED.clear()
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        STOP_REQUESTED.clear()  # this run's server has come and gone: nothing later inherits the request


def configure(flags: ServeFlags, config: ServeConfig) -> ServeConfig:
    """The bring-up flags resolved (the cluster secret is loaded by the command, fail closed)."""
    return replace(config, bringup=bringup_settings(flags.bringup, flags.server.host))


def run(context: RoleContext) -> int:
    """Role ``pp-auto``: the push, then the ``coordinator`` role on the generated TOML (or exit, dry run).

    SIGINT or SIGTERM during discovery or the push: exit 130 at once (no dial or read is waited for);
    after the push (the coordinator role starting, waiting for its stages, serving): exit 0."""
    with signals_interrupt():
        pushed: list[bool] = []
        try:
            return _run(context, pushed)
        except KeyboardInterrupt:
            if pushed:  # before the coordinator role's server took the signals over
                _say("stopped while starting the coordinator role")
                return 0
            print("mlxcel: interrupted", file=sys.stderr, flush=True)
            return EXIT_INTERRUPTED


def _run(context: RoleContext, pushed: list[bool]) -> int:
    from mlxcel.entrypoints import ROLES

    config = context.config
    settings, secret = config.bringup, config.secret
    assert settings is not None and secret is not None  # configure set them
    plan, pool = push(config.server.model, settings, secret)
    pushed.append(True)
    path = settings.config_path().resolve()
    if settings.dry_run:
        _say(f"dry run: planned {_describe(plan)}; wrote {path}")
        return 0
    _say(f"assigned {_describe(plan)}; wrote {path}")
    dist = from_toml(path, COORDINATOR_NODE_ID, config.pipeline)
    coordinator = context.as_role("coordinator", dist)
    if pool is not None:  # the coordinator role re-assigns restarted peers and hands stages that stay down to spares
        coordinator = replace(coordinator, config=replace(coordinator.config, replacer=pool))
    return ROLES["coordinator"].run(coordinator)
