"""Shared fixtures: transports on distinct loopback addresses, raw attack clients, cleanup."""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from typing import Callable, Iterator

import pytest

from mlxcel.cluster.frames import FrameOpener, FrameSealer
from mlxcel.cluster.handshake import ClientHandshake
from mlxcel.cluster.messages import Message
from mlxcel.cluster.ratelimit import RateLimitedLog
from mlxcel.cluster.secret import ClusterSecret
from mlxcel.cluster.transport import Transport, client_handshake
from mlxcel.cluster.wire import Channel, Kind, Suite
from tests import waiting

SECRET_BYTES = b"correct-horse-battery-staple-0123456789"
OTHER_BYTES = b"another-cluster-entirely-9876543210"

# distinct loopback addresses act as distinct hosts
SERVER_IP = "127.0.0.2"
CLIENT_IP = "127.0.0.3"
HONEST_IP = "127.0.0.4"


def _loopback_aliases_work() -> bool:
    try:
        with socket.socket() as s:
            s.bind((CLIENT_IP, 0))
        return True
    except OSError:
        return False


if not _loopback_aliases_work():  # macOS has only 127.0.0.1 on lo0 by default
    pytest.skip("127.0.0.x aliases are not bindable here", allow_module_level=True)


@pytest.fixture
def secret() -> ClusterSecret:
    return ClusterSecret(SECRET_BYTES, source="test")


@pytest.fixture
def other_secret() -> ClusterSecret:
    return ClusterSecret(OTHER_BYTES, source="test")


class Inbox:
    """Collects delivered messages; RPC handler echoes."""

    def __init__(self) -> None:
        self.q: queue.Queue[Message] = queue.Queue()

    def on_message(self, msg: Message) -> None:
        self.q.put(msg)

    @staticmethod
    def on_request(msg: Message) -> bytes:
        if bytes(msg.payload) == b"boom":
            raise ValueError("handler exploded")
        return b"echo:" + bytes(msg.payload)

    def get(self, timeout: float = 5.0) -> Message:
        return self.q.get(timeout=timeout)


@pytest.fixture
def make_transport(secret: ClusterSecret) -> Iterator[Callable[..., Transport]]:
    """Factory of transports closed at teardown."""
    made: list[Transport] = []

    def make(ip: str = SERVER_IP, sec: ClusterSecret | None = None, **kw: object) -> Transport:
        kw.setdefault("reconnect_base_delay", 0.01)
        kw.setdefault("max_reconnect_attempts", 2)
        kw.setdefault("reconnect_budget", 0)  # the attempt count alone: fast failures
        kw.setdefault("warnings", RateLimitedLog(logging.getLogger("mlxcel.cluster")))
        t = Transport(f"{ip}:0", sec or secret, **kw)
        made.append(t)
        return t

    yield make
    for t in made:
        t.close()


@pytest.fixture
def server(make_transport: Callable[..., Transport]) -> tuple[Transport, Inbox]:
    """A serving transport on SERVER_IP with an inbox and an echo RPC handler."""
    inbox = Inbox()
    t = make_transport(SERVER_IP, handshake_timeout=1.0)
    t.serve(inbox.on_message, inbox.on_request)
    return t, inbox


def assert_serves(server: Transport, secret: ClusterSecret, ip: str = HONEST_IP) -> None:
    """An honest peer (fresh transport) completes a handshake and an RPC round trip."""
    with Transport(f"{ip}:0", secret) as honest:
        assert bytes(honest.request(server.identity, b"ping", timeout=5)) in (b"echo:ping", b"ok")


class RawClient:
    """A hand-driven client over a real socket: handshake with a chosen secret, then raw frames."""

    def __init__(self, server: Transport, secret: ClusterSecret, ip: str = CLIENT_IP, *, suite: Suite = Suite.AES_256_GCM, identity: str | None = None) -> None:
        self.sock = socket.socket()
        self.sock.bind((ip, 0))
        self.sock.connect(server.identity.address)
        self.hs = ClientHandshake(secret, identity or f"{ip}:1", suite=suite, channel=Channel.TRANSPORT)
        self.suite = suite
        self.sealer: FrameSealer | None = None
        self.opener: FrameOpener | None = None

    def handshake(self) -> "RawClient":
        est = client_handshake(self.sock, self.hs, 5.0)
        self.sealer = FrameSealer(est.suite, est.send_key)
        self.opener = FrameOpener(est.suite, est.recv_key)
        return self

    def seal(self, kind: int, payload: bytes) -> bytes:
        assert self.sealer is not None
        return self.sealer.seal(kind, payload)

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def closed_by_peer(self, timeout: float = 3.0) -> bool:
        """True when the server closed (EOF or reset) within ``timeout``."""
        self.sock.settimeout(timeout)
        try:
            while True:
                data = self.sock.recv(65536)
                if not data:
                    return True
        except (ConnectionResetError, BrokenPipeError):
            return True
        except socket.timeout:
            return False

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def raw_clients() -> Iterator[list[RawClient]]:
    clients: list[RawClient] = []
    yield clients
    for c in clients:
        c.close()


def cluster_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("mlxcel-cluster")]


@pytest.fixture(autouse=True)
def no_leaked_threads() -> Iterator[None]:
    """Every test must leave no transport thread behind."""
    yield
    deadline = time.monotonic() + 3.0
    while cluster_threads() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not cluster_threads(), f"leaked threads: {cluster_threads()}"


def wait_until(pred: Callable[[], bool], timeout: float = 3.0) -> bool:
    """``tests.waiting.wait_until`` with this package's patience: 3 s, polled every 10 ms."""
    return waiting.wait_until(pred, timeout, every=0.01)


__all__ = ["Kind"]
