"""Role ``pp-peer``: wait for a stage assignment, then serve that stage.

The peer listens on ``--cluster-control-addr`` for the coordinator's assignment (beaconing under
``--cluster-discovery=mdns``). Once activated it writes the cluster TOML it received to
``--cluster-config-out`` and becomes that TOML's ``stage-<i>`` node: the role table picks the
``stage`` role for it, exactly as for ``--distributed-config <that file> --node-id stage-<i>``, on the
same address. While it waits, its HTTP port answers ``/health`` with 503 and
``{"status": "waiting" | "assigning", ...}``. A fatal refusal ends it with "stage assignment
refused"; SIGINT/SIGTERM while waiting end it with exit 0.
"""

from __future__ import annotations

import signal
import sys
import threading
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlxcel import __version__
from mlxcel.errors import CLIError
from mlxcel.topology.partition import PartitionError, format_range, human_bytes, layer_costs
from mlxcel.process import Endpoint, ExitSwitch, http_server
from mlxcel.entrypoints.context import RoleContext, ServeConfig
from mlxcel.topology.distributed import from_toml

from mlxcel.bringup.agent import Activation, PeerAgent, physical_memory
from mlxcel.bringup.errors import AssignmentRefused, AssignmentTimeout
from mlxcel.bringup.flags import BringupSettings, bringup_settings
from mlxcel.bringup.machine import PeerFacts

if TYPE_CHECKING:
    from mlxcel.entrypoints.flags import ServeFlags


def _say(text: str) -> None:
    print(f"mlxcel: pp-peer: {text}", file=sys.stderr, flush=True)


def local_facts(model: Path, settings: BringupSettings) -> PeerFacts:
    """This peer's versions, cluster, checkpoint identity, parameter bytes and memory."""
    from mlxcel.models.identity import model_identity

    try:
        costs = layer_costs(model)
    except PartitionError as exc:
        raise CLIError(str(exc)) from None
    return PeerFacts(mlxcel=__version__, cluster=settings.cluster, model_identity=model_identity(model),
                     costs=costs, memory=physical_memory(), listener=settings.control)


def waiting_app(agent: PeerAgent, settings: BringupSettings) -> Any:
    """The peer's HTTP port while it waits: ``/health`` answers 503 with what the peer is doing."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    app = FastAPI(title="mlxcel pp-peer", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/health")
    def health() -> JSONResponse:
        body = {"status": agent.state, "role": "pp-peer", "cluster": settings.cluster,
                "listener": str(agent.address), "discovery": settings.discovery}
        return JSONResponse(body, status_code=503, headers={"Retry-After": "1"})

    return app


def wait_serving_health(endpoint: Endpoint, agent: PeerAgent, settings: BringupSettings,
                        stop: threading.Event) -> Activation | None:
    """Run ``agent.wait`` on a thread while uvicorn answers ``/health`` on a duplicate of the bound
    socket (the original stays open for the stage role); ``stop`` (or SIGINT/SIGTERM, which uvicorn
    turns into an exit) ends the wait with None."""
    switch = ExitSwitch()
    outcome: dict[str, Any] = {}

    def wait() -> None:
        try:
            outcome["activation"] = agent.wait(stop)
        except (AssignmentRefused, AssignmentTimeout) as exc:
            outcome["error"] = exc
        finally:
            switch.stop()

    server = http_server(waiting_app(agent, settings), switch, endpoint)
    waiter = threading.Thread(target=wait, name="mlxcel-pp-peer-wait", daemon=True)
    sock = endpoint.sock.dup()
    waiter.start()
    try:
        server.run(sockets=[sock])
    finally:
        stop.set()
        waiter.join()
        sock.close()
    if "error" in outcome:
        raise CLIError(str(outcome["error"]))
    return outcome.get("activation")


class _Signals:
    """From the start of the role until the stage takes over: SIGINT/SIGTERM set ``stop`` (uvicorn
    installs its own handlers while it runs and puts these back afterwards)."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "_Signals":
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, lambda signum, frame: self.stop.set())
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def configure(flags: ServeFlags, config: ServeConfig) -> ServeConfig:
    """The bring-up flags resolved (the cluster secret is loaded by the command, fail closed)."""
    return replace(config, bringup=bringup_settings(flags.bringup, flags.server.host))


def run(context: RoleContext) -> int:
    """Role ``pp-peer``: wait for the assignment, then run the ``stage`` role on the TOML received."""
    from mlxcel.entrypoints import ROLES

    settings, secret = context.config.bringup, context.config.secret
    assert settings is not None and secret is not None  # configure set them
    facts = local_facts(context.config.server.model, settings)
    agent = PeerAgent(settings, facts, secret)
    with _Signals() as signals:
        try:
            address = agent.start()
        except OSError as exc:
            raise CLIError(f"cannot listen for the assignment on {settings.control}: {exc.strerror or exc}") from None
        how = (f"beaconing to {settings.discovery_target}:{settings.discovery_port}" if settings.discovery == "mdns"
               else "static discovery")
        _say(f"waiting for a stage assignment on {address} (cluster {settings.cluster!r}, {how}, "
             f"{human_bytes(facts.memory)} of memory), health on {context.endpoint.url('/health')}")
        try:
            activation = wait_serving_health(context.endpoint, agent, settings, signals.stop)
        finally:
            agent.close()
    if activation is None:
        _say("stopped while waiting for an assignment")
        return 0
    a = activation.assignment
    _say(f"activated as {a.node_id} (layers {format_range(*a.layers)}) by the coordinator at {a.coordinator}; "
         f"wrote {activation.path}")
    dist = from_toml(activation.path, a.node_id)  # what a later --distributed-config run reads
    return ROLES["stage"].run(context.as_role("stage", dist))

