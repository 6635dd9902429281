"""What the prefill and decode services share: the role transport, the STATE answer, sending to a router."""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable

from mlxcel.cluster.errors import RequestError
from mlxcel.cluster.identity import PeerId
from mlxcel.cluster.messages import Message
from mlxcel.cluster.secret import ClusterSecret
from mlxcel.cluster.transport import Transport
from mlxcel.cluster.wire import Kind
from mlxcel.disagg import messages as m
from mlxcel.disagg.flags import NodeConfig
from mlxcel.disagg.wire import DIAL_RETRIES, MsgType
from mlxcel.error_codes import ErrorCode
from mlxcel.cluster.outbox import Outbox

log = logging.getLogger("mlxcel.disagg")


def role_transport(cfg: NodeConfig, secret: ClusterSecret) -> Transport:
    """The node's authenticated transport: identity = --serving-bind; a dead peer is known after one quick retry
    (unless the cluster TOML's [transport] sets max_reconnect_attempts; its other keys apply as they are)."""
    options = {"max_reconnect_attempts": DIAL_RETRIES, "reconnect_budget": 0, **dict(cfg.transport)}
    return Transport(cfg.serving_bind, secret, **options)


class RoleService:
    """A prefill or decode node on its transport: CONTROL messages to ``on_control``, STATE by RPC."""

    role = ""

    def __init__(self, cfg: NodeConfig, identity: str, secret: ClusterSecret):
        self.cfg = cfg
        self.identity = identity  # the model identity (routers refuse a node serving another model)
        self.boot_id = os.urandom(8).hex()
        self.transport = role_transport(cfg, secret)
        self.outbox = Outbox(self.transport)
        self.lock = threading.Lock()
        self.started = time.monotonic()
        self.refused = 0  # control messages refused as malformed
        self.draining = False  # SIGUSR1 (mlxcel.loading_process): routers send no new request; the rest finishes

    def serve(self) -> None:
        self.transport.serve(self._on_message, self._on_request)

    def _on_message(self, msg: Message) -> None:
        if msg.kind is not Kind.CONTROL:
            self.on_stream(msg)
            return
        try:
            kind, doc = m.decode(msg.payload)
            self.on_control(msg.peer, kind, doc)
        except m.MessageRefused as exc:
            self.refused += 1
            log.warning("%s: refusing a control message from %s: %s", self.role, msg.peer, exc)
            self._answer_refusal(msg, exc)

    def _answer_refusal(self, msg: Message, exc: m.MessageRefused) -> None:
        """A malformed request whose nonce reads is answered with ERROR; anything else is only logged."""
        try:
            _, doc = m.decode(msg.payload)
            nonce = m.nonce_of(doc)
        except m.MessageRefused:
            return
        self.send(msg.peer, m.Error(nonce, exc.code, f"{self.role} node refused the message: {exc}"))

    def _on_request(self, msg: Message) -> bytes:
        try:
            kind, _ = m.decode(msg.payload)
        except m.MessageRefused as exc:
            raise RequestError(ErrorCode.BAD_REQUEST, str(exc)) from None
        if kind is not MsgType.STATE:
            raise RequestError(ErrorCode.UNSUPPORTED, f"a {self.role} node answers STATE requests only")
        return m.state_doc(role=self.role, boot_id=self.boot_id, model=self.identity, **self.state(),
                           draining=self.draining)

    def send(self, peer: PeerId, message: Any, on_error: Callable[[BaseException], None] | None = None) -> None:
        """A control message to ``peer`` (a router), in order, never blocking on a dead peer."""
        self.outbox.send(peer, Kind.CONTROL, message.encode(), on_error or (lambda exc: log.info(
            "%s: cannot reach %s: %s", self.role, peer, exc)))

    # -- for subclasses ---------------------------------------------------------------------------

    def on_control(self, peer: PeerId, kind: MsgType, doc: dict[str, Any]) -> None:
        raise NotImplementedError

    def on_stream(self, msg: Message) -> None:
        log.debug("%s: dropping a %s message from %s", self.role, msg.kind.name, msg.peer)

    def state(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        self.outbox.close()
        self.transport.close()
