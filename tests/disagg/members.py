"""Stand-in cluster members for router tests: secret holders at configured node addresses (real sockets,
the real handshake) that answer the router's STATE probes as a role and record every control message."""

from __future__ import annotations

import time

from mlxcel.cluster.identity import PeerId
from mlxcel.cluster.secret import ClusterSecret
from mlxcel.cluster.transport import Transport
from mlxcel.cluster.wire import Kind
from mlxcel.disagg import messages as m
from mlxcel.disagg.wire import MsgType


class Member:
    """A secret holder at ``bind``: answers STATE as ``role``, records control messages."""

    def __init__(self, bind: str, secret: ClusterSecret, role: str, model: str):
        self.bind, self.secret, self.role, self.model = bind, secret, role, model
        self.got: list[tuple[MsgType, dict]] = []
        self.state = m.state_doc(role=role, boot_id="00" * 8, model=model, ready=True)
        self.transport = Transport(bind, secret, max_reconnect_attempts=1, reconnect_budget=0)
        self.transport.serve(on_message=self._message, on_request=lambda msg: self.state)

    def _message(self, msg) -> None:
        if msg.kind is Kind.CONTROL:
            kind, doc = m.decode(msg.payload)
            self.got.append((kind, {**doc, "_at": time.monotonic()}))  # when it came (not a wire field)

    def of(self, kind: MsgType) -> list[dict]:
        return [doc for k, doc in list(self.got) if k is kind]

    def send(self, router: PeerId, payload: bytes) -> None:
        self.transport.send(router, Kind.CONTROL, payload)

    def close(self) -> None:
        self.transport.close()
