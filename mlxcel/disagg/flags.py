"""The disaggregated roles' flags and TOML nodes -> one ``NodeConfig`` (docs/disagg.md §2).

``--node-role prefill|decode|router|hybrid`` (default hybrid: today's single node), ``--serving-bind``
(this node's role-transport listener and identity), ``--prefill-peers`` and ``--decode-peers``; or a
``[[nodes]]`` entry of role prefill, decode or router in the cluster TOML (``--distributed-config``,
``--node-id``), whose address is the serving bind and whose fellow nodes are the peers. Every
non-hybrid role needs the cluster secret and refuses to start without one, naming every source (loaded once,
by ``mlxcel/commands/serve.py``, and handed to ``node_config``). ``DisaggFlags`` adds the flags to the server's
parser and checks them once per start.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from mlxcel.cluster.identity import PeerId
from mlxcel import envs
from mlxcel.config import DEFAULT_MAX_QUEUE, DEFAULT_MAX_RESUMES, DEFAULT_RESUME_TIMEOUT_S
from mlxcel.disagg.prefix_routing import DEFAULT_INDEX_BLOCKS
from mlxcel.disagg.wire import (
    DEFAULT_HANDOFF_TIMEOUT_S,
    DEFAULT_SPLIT_MIN_BYTES,
    DEFAULT_PROBE_INTERVAL_S,
    MIN_HANDOFF_TIMEOUT_S,
    PROGRESS_INTERVAL_S,
)
from mlxcel.errors import CLIError
from mlxcel.flagset import FlagSet
from mlxcel.threads import TRANSPORT_SWITCH_INTERVAL_MS, transport_switch_interval
from mlxcel.topology.names import DISAGG_ROLES, HYBRID, NODE_ROLE_CHOICES

if TYPE_CHECKING:
    from mlxcel.cluster.secret import ClusterSecret
    from mlxcel.topology.distributed import Distributed

_ROLE_FLAGS = ("serving_bind", "prefill_peers", "decode_peers", "handoff_timeout", "probe_interval", "route_policy",
               "route_index_blocks")
_ROUTER_FLAGS = ("probe_interval", "route_policy", "route_index_blocks")
ROUTE_POLICIES = ("prefix", "round-robin")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclass(frozen=True)
class NodeConfig:
    """What a prefill, decode or router process needs to join its peers (but the cluster secret:
    ``ServeConfig.secret``, handed to the role's transport)."""

    role: str
    serving_bind: PeerId
    prefill_peers: tuple[PeerId, ...]
    decode_peers: tuple[PeerId, ...]
    handoff_timeout_s: float = DEFAULT_HANDOFF_TIMEOUT_S
    probe_interval_s: float = DEFAULT_PROBE_INTERVAL_S
    node_id: str = ""
    max_resumes: int = DEFAULT_MAX_RESUMES  # router: resumes per request after a node failure (§6)
    resume_timeout_s: float = DEFAULT_RESUME_TIMEOUT_S  # router: one resume waits this long for a node of each role
    hold_limit: int = DEFAULT_MAX_QUEUE  # router: new requests held at most at once while no node of a role is up
    switch_interval_s: float = TRANSPORT_SWITCH_INTERVAL_MS / 1000  # prefill, decode: the GIL's (mlxcel/threads.py)
    handoff_lanes: int = 1  # prefill: connections to one decode node handoffs spread over (MLXCEL_HANDOFF_LANES)
    split_min_bytes: int = DEFAULT_SPLIT_MIN_BYTES  # prefill: a handoff this large is split over every lane
    intake_workers: int = 0  # decode: threads feeding handoff parts to their decoders (MLXCEL_HANDOFF_INTAKE_WORKERS)
    handoff_copy: bool = False  # decode: receive into numpy buffers copied at import (MLXCEL_HANDOFF_COPY=1)
    handoff_staging: bool | None = None  # prefill, decode: page-locked staging (MLXCEL_HANDOFF_STAGING; None: on CUDA)
    transport: tuple[tuple[str, Any], ...] = ()  # the cluster TOML's [transport] overrides (none with flags alone)
    route_policy: str = "prefix"  # router: how it picks a prefill node (--route-policy; docs/disagg.md §6)
    route_index_blocks: int = DEFAULT_INDEX_BLOCKS  # router: prompt block hashes kept per prefill node


def parse_address(text: str, flag: str) -> PeerId:
    try:
        peer = PeerId.parse(text.strip())
    except ValueError:
        raise CLIError(f"{flag}: {text.strip()!r} is not a numeric ip:port address") from None
    if peer.port == 0:
        raise CLIError(f"{flag}: {peer} needs a fixed port (peers dial it)")
    return peer


def parse_peers(text: str | None, flag: str) -> tuple[PeerId, ...]:
    if text is None:
        return ()
    peers = [parse_address(item, flag) for item in text.split(",") if item.strip()]
    if not peers:
        raise CLIError(f"{flag} names no address")
    if len(set(peers)) != len(peers):
        raise CLIError(f"{flag} names an address twice")
    for peer in peers:
        if peer.ip.is_unspecified:
            raise CLIError(f"{flag}: {peer} is not an address a node can be reached at")
    return tuple(peers)


@dataclass(frozen=True)
class DisaggFlags(FlagSet):
    """The disaggregated roles' flags as parsed (``add_disagg_arguments``)."""

    node_role: str | None = None
    serving_bind: str | None = None
    prefill_peers: str | None = None
    decode_peers: str | None = None
    handoff_timeout: float | None = None
    probe_interval: float | None = None
    route_policy: str | None = None
    route_index_blocks: int | None = None

    @staticmethod
    def add_arguments(group: Any) -> None:
        add_disagg_arguments(group)

    def role(self, dist: Distributed | None) -> str:
        """The role this process plays: the TOML node's, else ``--node-role``, else hybrid."""
        if dist is not None:
            return dist.node.role
        return self.node_role or HYBRID

    def _given(self) -> list[str]:
        return [_flag(f) for f in _ROLE_FLAGS if getattr(self, f) is not None]

    def wanted(self, dist: Distributed | None) -> bool:
        """A disaggregated role is configured, or one of its flags is given (then ``check`` says what is missing)."""
        return self.role(dist) in DISAGG_ROLES or bool(self._given())

    def check(self, dist: Distributed | None, *, pp_auto: int | None = None, pp_peer: bool = False) -> str:
        """Flag combinations of the roles (before anything loads), once per start; returns the role."""
        explicit, given = self.node_role, self._given()
        if dist is not None:
            if explicit not in (None, dist.node.role):
                raise CLIError(f"--node-role {explicit} contradicts node {dist.node.id!r}, whose role in "
                               f"{dist.cluster.path} is {dist.node.role!r}")
            toml_given = [f for f in given if f in ("--serving-bind", "--prefill-peers", "--decode-peers")]
            if dist.node.role in DISAGG_ROLES and toml_given:
                raise CLIError("--serving-bind, --prefill-peers and --decode-peers come from the cluster TOML when "
                               "--distributed-config is given")
        role = self.role(dist)
        if role not in DISAGG_ROLES:
            if given:
                raise CLIError(f"{', '.join(given)} {'needs' if len(given) == 1 else 'need'} --node-role prefill, "
                               "decode or router")
            return role
        if pp_auto is not None or pp_peer:
            raise CLIError(f"--node-role {role} cannot be combined with --pp-auto or --pp-peer")
        timeout = self.handoff_timeout
        if timeout is not None and timeout < MIN_HANDOFF_TIMEOUT_S:
            raise CLIError(f"--handoff-timeout must be at least {MIN_HANDOFF_TIMEOUT_S:g} s (nodes report progress "
                           f"every {PROGRESS_INTERVAL_S:g} s), got {timeout:g}")
        if dist is None:
            self._check_cli_role(role)
        if role != "router":
            self._check_router_only()
        return role

    def _check_cli_role(self, role: str) -> None:
        if self.serving_bind is None:
            raise CLIError(f"--node-role {role} needs --serving-bind IP:PORT (its cluster listener, the address peers "
                           "see it connect from)")
        parse_address(self.serving_bind, "--serving-bind")
        prefill = parse_peers(self.prefill_peers, "--prefill-peers")
        decode = parse_peers(self.decode_peers, "--decode-peers")
        if role == "router" and (not prefill or not decode):
            raise CLIError("--node-role router needs --prefill-peers and --decode-peers (the nodes it balances)")
        if role != "router" and prefill:
            raise CLIError(f"--prefill-peers is a router flag; a {role} node does not use it")
        if role == "decode" and decode:
            raise CLIError("--decode-peers is for routers and prefill nodes; a decode node does not use it")

    def _check_router_only(self) -> None:
        for name in _ROUTER_FLAGS:
            if getattr(self, name) is not None:
                raise CLIError(f"{_flag(name)} is a router flag")


def node_config(flags: DisaggFlags, dist: Distributed | None, max_resumes: int | None = None,
                resume_timeout: float | None = None, max_queue: int | None = None) -> NodeConfig:
    """This node's configuration (its flags checked once already, ``DisaggFlags.check``) and, for a prefill or
    decode node, the environment variables of its transport: ``MLXCEL_SWITCH_INTERVAL_MS``,
    ``MLXCEL_HANDOFF_STAGING``, ``MLXCEL_HANDOFF_LANES`` and ``MLXCEL_HANDOFF_SPLIT_MIN_BYTES`` (prefill), ``MLXCEL_HANDOFF_INTAKE_WORKERS`` and
    ``MLXCEL_HANDOFF_COPY`` (decode). A bad value of any variable is a ``CLIError`` naming it (mlxcel/envs.py).
    ``max_resumes``, ``resume_timeout``: --max-resumes and --resume-timeout (None: the default, the TOML's
    resume_s); ``max_queue``: --max-queue, a router's hold limit (None: the default)."""
    envs.check()
    hold = DEFAULT_MAX_QUEUE if max_queue is None else max_queue
    cfg = _addresses(flags, dist, (max_resumes, resume_timeout), hold)
    if cfg.role == "router":  # the variables are not the router's
        return replace(cfg, route_policy=flags.route_policy or "prefix",
                       route_index_blocks=flags.route_index_blocks or DEFAULT_INDEX_BLOCKS)
    return replace(cfg, switch_interval_s=transport_switch_interval(), **_handoff_environment(cfg.role))


def _handoff_environment(role: str) -> dict[str, Any]:
    """The handoff settings of a prefill or decode node, from the parsed environment (mlxcel/envs.py)."""
    from mlxcel.disagg.intake import default_workers
    from mlxcel.disagg.lanes import default_lanes, split_min_bytes

    staging = envs.settings().handoff_staging
    if role == "prefill":
        return {"handoff_lanes": default_lanes(), "split_min_bytes": split_min_bytes(), "handoff_staging": staging}
    return {"intake_workers": default_workers(), "handoff_copy": envs.settings().handoff_copy is True,
            "handoff_staging": staging}


def _addresses(flags: DisaggFlags, dist: Distributed | None, resume: tuple[int | None, float | None],
               hold: int) -> NodeConfig:
    role = flags.role(dist)
    if role not in DISAGG_ROLES:
        raise CLIError(f"{role} is not a disaggregated role")
    timeout = flags.handoff_timeout or DEFAULT_HANDOFF_TIMEOUT_S
    probe = flags.probe_interval
    if dist is not None:
        cluster = dist.cluster
        peers = {r: tuple(n.address for n in cluster.with_role(r)) for r in ("prefill", "decode")}
        return NodeConfig(role, dist.node.address, peers["prefill"] if role == "router" else (),
                          peers["decode"] if role != "decode" else (), timeout,
                          probe or cluster.timeouts.heartbeat_s, dist.node.id, *_resume(resume, cluster.timeouts.resume_s),
                          hold, transport=cluster.transport)
    assert flags.serving_bind is not None  # check refused a role without it
    bind = parse_address(flags.serving_bind, "--serving-bind")
    return NodeConfig(role, bind, parse_peers(flags.prefill_peers, "--prefill-peers"),
                      parse_peers(flags.decode_peers, "--decode-peers"), timeout,
                      probe or DEFAULT_PROBE_INTERVAL_S, f"{role}@{bind}", *_resume(resume, DEFAULT_RESUME_TIMEOUT_S),
                      hold)


def _resume(resume: tuple[int | None, float | None], toml_timeout_s: float) -> tuple[int, float]:
    """--max-resumes and --resume-timeout (the TOML's [timeouts] resume_s where the flag is not given)."""
    count, timeout = resume
    return (DEFAULT_MAX_RESUMES if count is None else count), (toml_timeout_s if timeout is None else timeout)


def _blocks(text: str) -> int:
    """--route-index-blocks: a positive integer."""
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_disagg_arguments(group: Any) -> None:
    """The flags, on the argument group ``mlxcel/commands/serve.py`` gives them."""
    from mlxcel.config import seconds

    group.add_argument("--node-role", choices=NODE_ROLE_CHOICES, default=None,
                       help="this process's role (default hybrid: one node does everything); prefill, decode and "
                            "router need the cluster secret")
    group.add_argument("--serving-bind", default=None, metavar="IP:PORT",
                       help="prefill/decode/router: the role transport's listener; its IP must be the one peers "
                            "see this node connect from")
    group.add_argument("--prefill-peers", default=None, metavar="A:P,...",
                       help="router: the prefill nodes' --serving-bind addresses")
    group.add_argument("--decode-peers", default=None, metavar="A:P,...",
                       help="router: the decode nodes' --serving-bind addresses; prefill: the fallback handoff "
                            "target (its first entry) when a request names none")
    group.add_argument("--handoff-timeout", type=seconds, default=None, metavar="S",
                       help=f"router: a request fails when no result arrives this long after dispatch or between "
                            f"two results (default {DEFAULT_HANDOFF_TIMEOUT_S:g})")
    group.add_argument("--route-policy", choices=ROUTE_POLICIES, default=None,
                       help="router: how a request's prefill node is picked: prefix (default: the node that most "
                            "likely holds the prompt's longest prefix, within a load bound) or round-robin")
    group.add_argument("--route-index-blocks", type=_blocks, default=None, metavar="N",
                       help="router, --route-policy prefix: prompt block hashes (64 tokens each) kept per prefill node "
                            f"at most, the least recent go first (default {DEFAULT_INDEX_BLOCKS})")
    group.add_argument("--probe-interval", type=seconds, default=None, metavar="S",
                       help=f"router: liveness probe period of every node (default {DEFAULT_PROBE_INTERVAL_S:g}, "
                            "or the TOML's heartbeat_s)")
