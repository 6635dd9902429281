"""The bring-up flags, checked and resolved: ``--pp-auto N`` / ``--pp-peer`` and their ``--cluster-*`` flags.

``check_bringup_flags`` runs first among the server's flag checks, before anything is loaded or
bound (one ``CLIError`` line each); ``bringup_settings`` resolves the defaults for the two roles
(whose ``configure`` hooks, ``mlxcel/roles/pp_auto.py`` and ``pp_peer.py``, load the secret).
"""

from __future__ import annotations

import argparse
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from mlxcel.cluster.identity import PeerId
from mlxcel.config import DEFAULT_RESUME_TIMEOUT_S, count_up_to, seconds_up_to
from mlxcel.errors import CLIError

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


def _get(args: argparse.Namespace, name: str, default: object = None) -> object:
    return getattr(args, name, default)


spare_count = count_up_to(MAX_SPARES, " spare peers")  # --pp-spare
spare_seconds = seconds_up_to(MAX_SPARE_AFTER_S)  # --pp-spare-after


def _check_spare_flags(args: argparse.Namespace) -> None:
    spares, after = _get(args, "pp_spare"), _get(args, "pp_spare_after")
    if not _get(args, "pp_auto"):
        for value, flag in ((spares, "--pp-spare"), (after, "--pp-spare-after")):
            if value is not None:
                raise CLIError(f"{flag} needs --pp-auto (the coordinator keeps the spare peers and assigns them)")
    if after is not None and not spares:
        raise CLIError("--pp-spare-after needs --pp-spare 1 or more (with no spare peer there is nothing to assign)")
    resume = _get(args, "resume_timeout") or DEFAULT_RESUME_TIMEOUT_S
    if spares and (after or DEFAULT_SPARE_AFTER_S) >= resume:  # type: ignore[operator]
        raise CLIError(f"--pp-spare-after {after or DEFAULT_SPARE_AFTER_S:g} is not below the resume timeout "
                       f"({resume:g}s, --resume-timeout): requests in flight would fail before a spare takes "
                       "their stage over; lower --pp-spare-after or raise --resume-timeout")


def wants_bringup(args: argparse.Namespace) -> bool:
    """This process runs a bring-up role: --pp-auto, or --pp-peer without a cluster TOML."""
    return bool(_get(args, "pp_auto")) or (bool(_get(args, "pp_peer")) and _get(args, "distributed_config") is None)


def check_bringup_flags(args: argparse.Namespace) -> None:
    """Mutual exclusions and the bring-up flags' syntax; raises ``CLIError`` (nothing is bound yet)."""
    pp_auto, pp_peer = _get(args, "pp_auto"), bool(_get(args, "pp_peer"))
    if _get(args, "dry_run") and pp_peer:
        raise CLIError("--dry-run is for the --pp-auto coordinator only (it plans the cluster and exits); "
                       "a --pp-peer has nothing to plan")
    if pp_auto and pp_peer:
        raise CLIError("--pp-auto and --pp-peer are mutually exclusive: a process is the coordinator or a peer")
    if pp_auto and _get(args, "distributed_config") is not None:
        raise CLIError("--pp-auto and --distributed-config are mutually exclusive: --pp-auto plans the cluster and "
                       "writes its TOML; to start from a TOML use --distributed-config with --node-id")
    if _get(args, "dry_run") and not pp_auto:
        raise CLIError("--dry-run needs --pp-auto (it plans a zero-config cluster and exits)")
    _check_spare_flags(args)
    if not wants_bringup(args):
        if not pp_peer:  # a --pp-peer with --distributed-config skips the wait and ignores them
            for attr, flag in _BRINGUP_ONLY:
                if _get(args, attr) is not None:
                    raise CLIError(f"{flag} needs --pp-auto or --pp-peer (zero-config bring-up)")
        return
    bringup_settings(args)


def _peer_id(text: str, flag: str) -> PeerId:
    try:
        return PeerId.parse(text.strip())
    except ValueError:
        raise CLIError(f"{flag}: {text.strip()!r} is not a numeric ip:port address (e.g. 192.168.1.11:19001)") from None


def _cluster_name(args: argparse.Namespace) -> str:
    name = _get(args, "cluster_name") or DEFAULT_CLUSTER_NAME
    if not CLUSTER_NAME.match(name):  # type: ignore[arg-type]
        raise CLIError(f"--cluster-name {name!r}: 1 to 64 letters, digits, '.', '_' or '-', starting with a "
                       "letter or digit")
    return name  # type: ignore[return-value]


def _discovery(args: argparse.Namespace, coordinator: bool) -> tuple[str, str, int]:
    mode = _get(args, "cluster_discovery") or DEFAULT_DISCOVERY
    target, port = _get(args, "cluster_discovery_target"), _get(args, "cluster_discovery_port")
    if mode != "mdns":
        for value, flag in ((target, "--cluster-discovery-target"), (port, "--cluster-discovery-port")):
            if value is not None:
                raise CLIError(f"{flag} needs --cluster-discovery=mdns")
    if coordinator and target is not None:
        raise CLIError("--cluster-discovery-target is where a --pp-peer sends its beacons; the --pp-auto "
                       "coordinator listens on --cluster-discovery-port on every interface")
    target = target or DEFAULT_DISCOVERY_TARGET
    try:
        ipaddress.ip_address(target)  # type: ignore[arg-type]
    except ValueError:
        raise CLIError(f"--cluster-discovery-target: {target!r} is not a numeric IP address") from None
    return mode, target, DEFAULT_DISCOVERY_PORT if port is None else port  # type: ignore[return-value]


def bringup_settings(args: argparse.Namespace) -> BringupSettings:
    """Resolve the bring-up flags of a --pp-auto coordinator or a --pp-peer; raises ``CLIError``."""
    coordinator = bool(_get(args, "pp_auto"))
    cluster = _cluster_name(args)
    mode, target, port = _discovery(args, coordinator)
    if coordinator:
        control, peers = _coordinator_addresses(args, mode)
        out = _get(args, "cluster_config_out") or DEFAULT_COORDINATOR_CONFIG_OUT
    else:
        control, peers = _peer_address(args, mode), ()
        out = _get(args, "cluster_config_out") or DEFAULT_PEER_CONFIG_OUT
    after = _get(args, "pp_spare_after")
    return BringupSettings(stages=_get(args, "pp_auto") if coordinator else None, cluster=cluster,  # type: ignore[arg-type]
                           discovery=mode, control=control, peers=peers, discovery_target=target,
                           discovery_port=port, config_out=str(out), dry_run=bool(_get(args, "dry_run")),
                           spares=int(_get(args, "pp_spare") or 0),  # type: ignore[call-overload]
                           spare_after_s=DEFAULT_SPARE_AFTER_S if after is None else float(after))  # type: ignore[arg-type]


def _coordinator_addresses(args: argparse.Namespace, mode: str) -> tuple[PeerId, tuple[PeerId, ...]]:
    text = _get(args, "cluster_control_addr")
    if text is not None:
        control = _peer_id(text, "--cluster-control-addr")  # type: ignore[arg-type]
    else:
        host = _get(args, "host", "127.0.0.1")
        try:
            control = PeerId.of(host, DEFAULT_CONTROL_PORT)  # type: ignore[arg-type]
        except ValueError:
            raise CLIError(f"the coordinator's control address defaults to the --host IP on port {DEFAULT_CONTROL_PORT}, "
                           f"but --host {host!r} is not a numeric IP: pass --cluster-control-addr") from None
    if control.port == 0:
        raise CLIError("--cluster-control-addr needs a fixed port: the stages reply to it")
    n = _get(args, "pp_auto")
    spares = int(_get(args, "pp_spare") or 0)  # type: ignore[call-overload]
    listed = _get(args, "cluster_peers")
    if mode == "mdns":
        if listed is not None:
            raise CLIError("--cluster-peers is for static discovery; with --cluster-discovery=mdns the peers are "
                           "learned from their beacons")
        return control, ()
    want = n + spares  # type: ignore[operator]
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


def _peer_address(args: argparse.Namespace, mode: str) -> PeerId:
    if _get(args, "cluster_peers") is not None:
        raise CLIError("--cluster-peers is for the --pp-auto coordinator; a --pp-peer names its own address "
                       "with --cluster-control-addr")
    text = _get(args, "cluster_control_addr")
    listener = _peer_id(text, "--cluster-control-addr") if text is not None else PeerId.of("0.0.0.0", 0)  # type: ignore[arg-type]
    if mode == "static" and listener.port == 0:
        raise CLIError("a --pp-peer with static discovery needs --cluster-control-addr IP:PORT (the address the "
                       "coordinator lists in --cluster-peers), or --cluster-discovery=mdns to announce an "
                       "OS-assigned port")
    return listener
