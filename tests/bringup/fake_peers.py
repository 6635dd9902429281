"""In-process peers for tests of the real coordinator CLI: a real ``PeerAgent`` (real sockets, the real
handshake and state machine) on 127.0.0.x whose behaviour at one step is replaced.

``stall="query"`` never answers the query; ``stall="commit"`` accepts the offer and never answers
the commit; ``stall=None`` follows the protocol to activation but starts no stage, so the coordinator
is left waiting for it. ``mlxcel`` is the version the peer reports in ``info`` (and checks an offer against).
"""

from __future__ import annotations

import threading
from pathlib import Path

from mlxcel import __version__
from mlxcel.bringup.agent import PeerAgent
from mlxcel.bringup.flags import BringupSettings
from mlxcel.bringup.machine import PeerFacts, PeerMachine
from mlxcel.cluster.identity import PeerId
from mlxcel.cluster.secret import load_secret
from mlxcel.models.identity import model_identity
from mlxcel.topology.partition import layer_costs
from tests.bringup.procs import free_port


class FakePeer(PeerAgent):
    """A peer agent listening on ``host`` that stalls at ``stall`` (or starts no stage)."""

    def __init__(self, tmp: Path, host: str, model: Path, secret: Path, *, stall: str | None = None,
                 mlxcel: str = __version__) -> None:
        control = PeerId.of(host, free_port(host))
        settings = BringupSettings(stages=None, cluster="mlxcel-cluster", discovery="static", control=control,
                                   peers=(), discovery_target="127.0.0.1", discovery_port=0,
                                   config_out=str(tmp / f"fake-{host}" / "cluster-{node_id}.toml"), dry_run=False)
        facts = PeerFacts(mlxcel=mlxcel, cluster="mlxcel-cluster", model_identity=model_identity(model),
                          costs=layer_costs(model), memory=1 << 34, listener=control)
        super().__init__(settings, facts, load_secret(secret))
        self.stall = stall
        self.release = threading.Event()  # set at close: a stalled session ends
        self.queried = threading.Event()  # stall="query": a coordinator's session is open
        self.committing = threading.Event()  # stall="commit": the commit arrived
        self.start()

    def serve_session(self, session) -> None:  # noqa: ANN001 - the agent's _Session
        if self.stall == "query":
            self.queried.set()
            self.release.wait(120)
            return
        super().serve_session(session)

    def _prepare(self, machine: PeerMachine, staged: list[Path]) -> bytes:
        if self.stall == "commit":
            self.committing.set()
            self.release.wait(120)
        return super()._prepare(machine, staged)

    def close(self) -> None:
        self.release.set()
        super().close()
