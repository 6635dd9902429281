"""The bring-up flags, checked and resolved: ``--pp-auto N`` / ``--pp-peer`` and their ``--cluster-*`` flags.

``BringupFlags`` adds the group to the server's parser; its ``check`` runs first among the server's flag
checks, before anything is loaded or bound (one ``CLIError`` line each); ``bringup_settings`` resolves the
defaults for the two roles (``mlxcel/entrypoints/pp_auto.py`` and ``pp_peer.py``).
"""

from __future__ import annotations

import argparse
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from mlxcel.cluster.identity import PeerId
from mlxcel.config import DEFAULT_RESUME_TIMEOUT_S, count_up_to, positive_int, seconds_up_to, udp_port
from mlxcel.errors import CLIError
from mlxcel.flagset import FlagSet

from . import wire
from .wire import (
    CLUSTER_NAME,
    DEFAULT_CLUSTER_NAME,
    DEFAULT_CONTROL_PORT,
    DEFAULT_COORDINATOR_CONFIG_OUT,
    DEFAULT_DISCOVERY,
    DEFAULT_DISCOVERY_PORT,
    DEFAULT_DISCOVERY_TARGET,
    DEFAULT_PEER_CONFIG_OUT,
    DEFAULT_SPARE_AFTER_S,
    DEFAULT_SPARES,
    MAX_SPARE_AFTER_S,
    MAX_SPARES,
)

#: flags that only a --pp-auto coordinator or a --pp-peer reads (attribute, flag)
_BRINGUP_ONLY = (("cluster_name", "--cluster-name"), ("cluster_peers", "--cluster-peers"),
                 ("cluster_control_addr", "--cluster-control-addr"), ("cluster_discovery", "--cluster-discovery"),
                 ("cluster_discovery_target", "--cluster-discovery-target"),
                 ("cluster_discovery_port", "--cluster-discovery-port"), ("cluster_config_out", "--cluster-config-out"))


@dataclass(frozen=True)
class BringupSettings:
    """What a --pp-auto coordinator (``stages`` set) or a --pp-peer (``stages`` None) runs with."""

    stages: int | None
    cluster: str
    discovery: str  # "static" | "mdns"
    control: PeerId  # coordinator: its control address; peer: its assignment listener (port 0: any)
    peers: tuple[PeerId, ...]  # static discovery (coordinator)
    discovery_target: str
    discovery_port: int
    config_out: str  # may hold "{node_id}" (a peer's default)
    dry_run: bool
    spares: int = DEFAULT_SPARES  # --pp-spare: peers beyond the N stages wait as standbys (coordinator)
    spare_after_s: float = DEFAULT_SPARE_AFTER_S  # --pp-spare-after: a stage down this long goes to a spare

    @property
    def peer_count(self) -> int:
        """The peers a coordinator reaches: its N stages and its spares."""
        return (self.stages or 0) + self.spares

    @property
    def is_coordinator(self) -> bool:
        return self.stages is not None

    def config_path(self, node_id: str | None = None) -> Path:
        return Path(self.config_out.replace("{node_id}", node_id or ""))


spare_count = count_up_to(MAX_SPARES, " spare peers")  # --pp-spare
spare_seconds = seconds_up_to(MAX_SPARE_AFTER_S)  # --pp-spare-after


def add_bringup_arguments(parser: argparse.ArgumentParser) -> None:
    """The "zero-config bring-up" flag group (docs/bringup.md)."""
    group = parser.add_argument_group("zero-config bring-up (docs/bringup.md)")
    group.add_argument("--pp-auto", type=positive_int, default=None, metavar="N",
                       help="coordinator of an N-stage pipeline: find N --pp-peer processes, plan the cluster, "
                            "assign their stages and serve the API (runs no stage itself)")
    group.add_argument("--pp-peer", action="store_true",
                       help="wait for a stage assignment from a --pp-auto coordinator, then serve that stage")
    group.add_argument("--cluster-name", default=None, metavar="NAME",
                       help=f"the cluster's name; peers refuse another (default {wire.DEFAULT_CLUSTER_NAME})")
    group.add_argument("--cluster-peers", default=None, metavar="A:P,...",
                       help="--pp-auto, static discovery: the peers' --cluster-control-addr addresses")
    group.add_argument("--cluster-control-addr", default=None, metavar="IP:PORT",
                       help="coordinator: its cluster address (default: the --host IP, port "
                            f"{wire.DEFAULT_CONTROL_PORT}); peer: its listener for the assignment and then its "
                            "stage (default with mdns: 0.0.0.0 and an OS-assigned port)")
    group.add_argument("--cluster-discovery", choices=wire.DISCOVERY_MODES, default=None,
                       help=f"static (--cluster-peers) or mdns (signed UDP beacons) (default {wire.DEFAULT_DISCOVERY})")
    group.add_argument("--cluster-discovery-target", default=None, metavar="IP",
                       help=f"peer, mdns: where beacons go (default {wire.DEFAULT_DISCOVERY_TARGET}; a directed "
                            "broadcast or the coordinator's IP)")
    group.add_argument("--cluster-discovery-port", type=udp_port, default=None, metavar="PORT",
                       help=f"mdns: the beacons' UDP port (1-65535; default {wire.DEFAULT_DISCOVERY_PORT})")
    group.add_argument("--cluster-config-out", default=None, metavar="PATH",
                       help=f"where the cluster TOML is written (coordinator default {wire.DEFAULT_COORDINATOR_CONFIG_OUT}, "
                            f"peer default {wire.DEFAULT_PEER_CONFIG_OUT}; {{node_id}} becomes the assigned node id)")
    group.add_argument("--dry-run", action="store_true",
                       help="--pp-auto only: plan the cluster, write --cluster-config-out and exit")
    group.add_argument("--pp-spare", type=spare_count, default=None, metavar="K",
                       help=f"--pp-auto only: K more --pp-peer processes wait as standbys; a stage down longer than "
                            f"--pp-spare-after is assigned to one of them (0 to {wire.MAX_SPARES}; default "
                            f"{wire.DEFAULT_SPARES}; static discovery lists N+K peers)")
    group.add_argument("--pp-spare-after", type=spare_seconds, default=None, metavar="S",
                       help=f"--pp-auto with --pp-spare: how long a stage stays down before its layers go to a spare "
                            f"(> 0 to {wire.MAX_SPARE_AFTER_S:g} seconds and below --resume-timeout; default "
                            f"{wire.DEFAULT_SPARE_AFTER_S:g})")


@dataclass(frozen=True)
class BringupFlags(FlagSet):
    """The bring-up flags as parsed; ``check`` refuses bad combinations once per start (nothing bound yet)."""

    pp_auto: int | None = None
    pp_peer: bool = False
    cluster_name: str | None = None
    cluster_peers: str | None = None
    cluster_control_addr: str | None = None
    cluster_discovery: str | None = None
    cluster_discovery_target: str | None = None
    cluster_discovery_port: int | None = None
    cluster_config_out: str | None = None
    dry_run: bool = False
    pp_spare: int | None = None
    pp_spare_after: float | None = None

    add_arguments = staticmethod(add_bringup_arguments)

    def wanted(self, distributed_config: str | None) -> bool:
        """This process runs a bring-up role: --pp-auto, or --pp-peer without a cluster TOML."""
        return bool(self.pp_auto) or (self.pp_peer and distributed_config is None)

    def check(self, *, distributed_config: str | None, resume_timeout: float | None, host: str) -> None:
        """Mutual exclusions and the bring-up flags' syntax; raises ``CLIError``."""
        if self.dry_run and self.pp_peer:
            raise CLIError("--dry-run is for the --pp-auto coordinator only (it plans the cluster and exits); "
                           "a --pp-peer has nothing to plan")
        if self.pp_auto and self.pp_peer:
            raise CLIError("--pp-auto and --pp-peer are mutually exclusive: a process is the coordinator or a peer")
        if self.pp_auto and distributed_config is not None:
            raise CLIError("--pp-auto and --distributed-config are mutually exclusive: --pp-auto plans the cluster "
                           "and writes its TOML; to start from a TOML use --distributed-config with --node-id")
        if self.dry_run and not self.pp_auto:
            raise CLIError("--dry-run needs --pp-auto (it plans a zero-config cluster and exits)")
        self._check_spares(resume_timeout)
        if not self.wanted(distributed_config):
            if not self.pp_peer:  # a --pp-peer with --distributed-config skips the wait and ignores them
                for attr, flag in _BRINGUP_ONLY:
                    if getattr(self, attr) is not None:
                        raise CLIError(f"{flag} needs --pp-auto or --pp-peer (zero-config bring-up)")
            return
        bringup_settings(self, host)

    def _check_spares(self, resume_timeout: float | None) -> None:
        spares, after = self.pp_spare, self.pp_spare_after
        if not self.pp_auto:
            for value, flag in ((spares, "--pp-spare"), (after, "--pp-spare-after")):
                if value is not None:
                    raise CLIError(f"{flag} needs --pp-auto (the coordinator keeps the spare peers and assigns them)")
        if after is not None and not spares:
            raise CLIError("--pp-spare-after needs --pp-spare 1 or more (with no spare peer there is nothing to "
                           "assign)")
        resume = resume_timeout or DEFAULT_RESUME_TIMEOUT_S
        if spares and (after or DEFAULT_SPARE_AFTER_S) >= resume:
            raise CLIError(f"--pp-spare-after {after or DEFAULT_SPARE_AFTER_S:g} is not below the resume timeout "
                           f"({resume:g}s, --resume-timeout): requests in flight would fail before a spare takes "
                           "their stage over; lower --pp-spare-after or raise --resume-timeout")


def _peer_id(text: str, flag: str) -> PeerId:
    try:
        return PeerId.parse(text.strip())
    except ValueError:
        raise CLIError(f"{flag}: {text.strip()!r} is not a numeric ip:port address (e.g. 192.168.1.11:19001)") from None


def _cluster_name(flags: BringupFlags) -> str:
    name = flags.cluster_name or DEFAULT_CLUSTER_NAME
    if not CLUSTER_NAME.match(name):
        raise CLIError(f"--cluster-name {name!r}: 1 to 64 letters, digits, '.', '_' or '-', starting with a "
                       "letter or digit")
    return name


def _discovery(flags: BringupFlags, coordinator: bool) -> tuple[str, str, int]:
    mode = flags.cluster_discovery or DEFAULT_DISCOVERY
    target, port = flags.cluster_discovery_target, flags.cluster_discovery_port
    if mode != "mdns":
        for value, flag in ((target, "--cluster-discovery-target"), (port, "--cluster-discovery-port")):
            if value is not None:
                raise CLIError(f"{flag} needs --cluster-discovery=mdns")
    if coordinator and target is not None:
        raise CLIError("--cluster-discovery-target is where a --pp-peer sends its beacons; the --pp-auto "
                       "coordinator listens on --cluster-discovery-port on every interface")
    target = target or DEFAULT_DISCOVERY_TARGET
    try:
        ipaddress.ip_address(target)
    except ValueError:
        raise CLIError(f"--cluster-discovery-target: {target!r} is not a numeric IP address") from None
    return mode, target, DEFAULT_DISCOVERY_PORT if port is None else port


def bringup_settings(flags: BringupFlags, host: str) -> BringupSettings:
    """Resolve the bring-up flags of a --pp-auto coordinator or a --pp-peer (``host``: --host, the coordinator's
    default control IP); raises ``CLIError``."""
    coordinator = bool(flags.pp_auto)
    cluster = _cluster_name(flags)
    mode, target, port = _discovery(flags, coordinator)
    if coordinator:
        control, peers = _coordinator_addresses(flags, mode, host)
        out = flags.cluster_config_out or DEFAULT_COORDINATOR_CONFIG_OUT
    else:
        control, peers = _peer_address(flags, mode), ()
        out = flags.cluster_config_out or DEFAULT_PEER_CONFIG_OUT
    after = flags.pp_spare_after
    return BringupSettings(stages=flags.pp_auto if coordinator else None, cluster=cluster, discovery=mode,
                           control=control, peers=peers, discovery_target=target, discovery_port=port,
                           config_out=str(out), dry_run=flags.dry_run, spares=int(flags.pp_spare or 0),
                           spare_after_s=DEFAULT_SPARE_AFTER_S if after is None else float(after))


def _coordinator_addresses(flags: BringupFlags, mode: str, host: str) -> tuple[PeerId, tuple[PeerId, ...]]:
    text = flags.cluster_control_addr
    if text is not None:
        control = _peer_id(text, "--cluster-control-addr")
    else:
        try:
            control = PeerId.of(host, DEFAULT_CONTROL_PORT)
        except ValueError:
            raise CLIError(f"the coordinator's control address defaults to the --host IP on port {DEFAULT_CONTROL_PORT}, "
                           f"but --host {host!r} is not a numeric IP: pass --cluster-control-addr") from None
    if control.port == 0:
        raise CLIError("--cluster-control-addr needs a fixed port: the stages reply to it")
    n = flags.pp_auto or 0
    spares = int(flags.pp_spare or 0)
    listed = flags.cluster_peers
    if mode == "mdns":
        if listed is not None:
            raise CLIError("--cluster-peers is for static discovery; with --cluster-discovery=mdns the peers are "
                           "learned from their beacons")
        return control, ()
    want = n + spares
    with_spares = f" with --pp-spare {spares}" if spares else ""
    if listed is None:
        raise CLIError(f"--pp-auto {n}{with_spares} with static discovery needs --cluster-peers A:P,... ({want} peer "
                       "addresses), or --cluster-discovery=mdns")
    peers = tuple(_peer_id(item, "--cluster-peers") for item in str(listed).split(","))
    if len(set(peers)) != len(peers):
        raise CLIError("--cluster-peers lists an address twice")
    if len(peers) != want:
        listed_text = f"--cluster-peers lists {len(peers)} peer{'s' if len(peers) != 1 else ''}"
        if spares:
            raise CLIError(f"{listed_text} but --pp-auto {n} with --pp-spare {spares} needs {want} "
                           f"({n} stages and {spares} spare{'s' if spares != 1 else ''})")
        raise CLIError(f"{listed_text} but --pp-auto is {n}")
    for peer in peers:
        if peer.port == 0 or peer.ip.is_unspecified:
            raise CLIError(f"--cluster-peers: {peer} is not an address a peer listens on (a real IP and port)")
        if peer == control:
            raise CLIError(f"--cluster-peers: {peer} is the coordinator's own control address")
    check_reachable(control, peers)
    return control, peers


def check_reachable(control: PeerId, peers: tuple[PeerId, ...] | list[PeerId]) -> None:
    """A coordinator whose control address is on loopback cannot drive a peer on another host."""
    if not control.ip.is_loopback:
        return
    remote = [str(p) for p in peers if not p.ip.is_loopback]
    if remote:
        raise CLIError(f"the coordinator's control address {control} is on loopback, so the peer(s) "
                       f"{', '.join(remote)} on another host could not reach it: pass --cluster-control-addr "
                       "with an address of this host that the peers reach")


def _peer_address(flags: BringupFlags, mode: str) -> PeerId:
    if flags.cluster_peers is not None:
        raise CLIError("--cluster-peers is for the --pp-auto coordinator; a --pp-peer names its own address "
                       "with --cluster-control-addr")
    text = flags.cluster_control_addr
    listener = _peer_id(text, "--cluster-control-addr") if text is not None else PeerId.of("0.0.0.0", 0)
    if mode == "static" and listener.port == 0:
        raise CLIError("a --pp-peer with static discovery needs --cluster-control-addr IP:PORT (the address the "
                       "coordinator lists in --cluster-peers), or --cluster-discovery=mdns to announce an "
                       "OS-assigned port")
    return listener
