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
from mlxcel.bringup.messages import Msg, encode
from mlxcel.cluster.identity import PeerId
from mlxcel.cluster.wire import Kind
from mlxcel.cluster.secret import load_secret
from mlxcel.models.identity import model_identity
from mlxcel.topology.partition import layer_costs
from tests.bringup.procs import free_port


class FakePeer(PeerAgent):
    """A peer agent listening on ``host`` that stalls at ``stall`` (or starts no stage)."""

    def __init__(self, tmp: Path, host: str, model: Path, secret: Path, *, stall: str | None = None,
                 mlxcel: str = __version__, port: int | None = None) -> None:
        control = PeerId.of(host, port or free_port(host))
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


class LyingPeer(FakePeer):
    """Answers an offer with ``accepted`` for another node than the one offered (a wrong identity)."""

    def _drive(self, session, machine: PeerMachine, staged: list[Path]) -> None:  # noqa: ANN001
        chan = session.channel
        chan.send(machine.receive(chan.recv(machine.wait_s)).reply)  # query -> info
        offer = machine.receive(chan.recv(machine.wait_s))
        other = "stage-0" if offer.assignment.node_id != "stage-0" else "stage-1"
        chan.send(encode(Msg.ACCEPTED, node_id=other))
        _until_closed(chan)


class ReplayingPeer(FakePeer):
    """Records the sealed frame of its first ``accepted`` and, in every later session, sends those bytes
    again instead of a fresh answer to the offer (a replayed accept)."""

    recorded: bytes | None = None

    def _drive(self, session, machine: PeerMachine, staged: list[Path]) -> None:  # noqa: ANN001
        chan = session.channel
        chan.send(machine.receive(chan.recv(machine.wait_s)).reply)  # query -> info
        accepted = machine.receive(chan.recv(machine.wait_s)).reply
        if self.recorded is None:
            self.recorded = chan._sealer.seal(Kind.CONTROL, accepted)  # noqa: SLF001 - the bytes on the wire
        chan.sock.sendall(self.recorded)
        _until_closed(chan)


def _until_closed(chan) -> None:  # noqa: ANN001 - a FrameChannel
    """Read (and ignore) frames until the coordinator ends the session."""
    try:
        while True:
            chan.recv(10)
    except Exception:  # noqa: BLE001 - closed, timed out, or a frame that does not open: the session is over
        return
