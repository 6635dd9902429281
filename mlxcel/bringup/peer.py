"""Role ``pp-peer``: wait for a stage assignment, then serve that stage.

The peer listens on ``--cluster-control-addr`` for the coordinator's assignment (beaconing under
``--cluster-discovery=mdns``). Once activated it writes the cluster TOML it received to
``--cluster-config-out`` and becomes that TOML's ``stage-<i>`` node: the role table picks the
``stage`` role for it, exactly as for ``--distributed-config <that file> --node-id stage-<i>``, on the
same address. A fatal refusal ends it with "stage assignment refused"; SIGINT/SIGTERM while waiting
end it with exit 0.
"""

from __future__ import annotations

import signal
import sys
import threading
from dataclasses import replace
from typing import Any

from mlxcel import __version__
from mlxcel.cluster.secret import load_secret
from mlxcel.errors import CLIError
from mlxcel.pipeline.partition import PartitionError, format_range, human_bytes, layer_costs
from mlxcel.process import RoleContext

from .agent import Activation, PeerAgent, physical_memory
from .errors import AssignmentRefused, AssignmentTimeout
from .flags import BringupSettings, bringup_settings
from .machine import PeerFacts


def _say(text: str) -> None:
    print(f"mlxcel: pp-peer: {text}", file=sys.stderr, flush=True)


def local_facts(context: RoleContext, settings: BringupSettings) -> PeerFacts:
    """This peer's versions, cluster, checkpoint identity, parameter bytes and memory."""
    from mlxcel.models.identity import model_identity

    model = context.config.model
    try:
        costs = layer_costs(model)
    except PartitionError as exc:
        raise CLIError(str(exc)) from None
    return PeerFacts(mlxcel=__version__, cluster=settings.cluster, model_identity=model_identity(model),
                     costs=costs, memory=physical_memory(), listener=settings.control)


def _wait(agent: PeerAgent) -> Activation | None:
    """``agent.wait`` with SIGINT/SIGTERM turned into a clean stop (restored afterwards)."""
    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return agent.wait(stop)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run(context: RoleContext) -> int:
    """Role ``pp-peer``: wait for the assignment, then run the ``stage`` role on the TOML received."""
    from mlxcel.pipeline.cluster_config import ClusterConfigError, load_cluster_config
    from mlxcel.pipeline.runtime import Distributed
    from mlxcel.roles import select_role

    args = context.args
    settings = bringup_settings(args)
    secret = load_secret(args.cluster_secret_file, required=True)
    facts = local_facts(context, settings)
    agent = PeerAgent(settings, facts, secret)
    try:
        address = agent.start()
    except OSError as exc:
        raise CLIError(f"cannot listen for the assignment on {settings.control}: {exc.strerror or exc}") from None
    how = (f"beaconing to {settings.discovery_target}:{settings.discovery_port}" if settings.discovery == "mdns"
           else "static discovery")
    _say(f"waiting for a stage assignment on {address} (cluster {settings.cluster!r}, {how}, "
         f"{human_bytes(facts.memory)} of memory)")
    try:
        activation = _wait(agent)
    except (AssignmentRefused, AssignmentTimeout) as exc:
        raise CLIError(str(exc)) from None
    finally:
        agent.close()
    if activation is None:
        _say("stopped while waiting for an assignment")
        return 0
    a = activation.assignment
    _say(f"activated as {a.node_id} (layers {format_range(*a.layers)}) by the coordinator at {a.coordinator}; "
         f"wrote {activation.path}")
    try:
        cluster = load_cluster_config(activation.path)  # what a later --distributed-config run reads
        dist = Distributed(cluster, cluster.node(a.node_id), secret)
    except ClusterConfigError as exc:
        raise CLIError(str(exc)) from None
    return select_role(args, dist).run(replace(context, dist=dist))

