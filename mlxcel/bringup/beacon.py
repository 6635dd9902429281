"""Discovery beacons (``--cluster-discovery=mdns``): pure encode/verify, a UDP sender and a listener.

A beacon is one UDP datagram (docs/bringup.md §2):

    magic "MLXB" (4) || format version 1 (1) || timestamp, ms since the Unix epoch (u64 BE)
    || nonce (16) || V (1) || mlxcel version (V, ASCII) || C (1) || cluster name (C, ASCII)
    || A (1) || advertised address (A, ASCII "ip:port") || MAC (32)

    MAC = HMAC-SHA256(secret, "mlxcel-beacon-v1\\0" || every byte before the MAC)

The coordinator rejects (in this order) a malformed datagram, another format version, a MAC that
does not verify, another mlxcel version, a timestamp more than 60 s off its clock, a nonce it
accepted within that window (a replay) and an advertised address whose IP is not the datagram's
source IP (an unspecified IP takes the source IP). Malformed datagrams are logged in the noise
warning class, the typed rejections in the diagnostic class (``mlxcel/cluster/ratelimit.py``).
Beacons of another cluster name are ignored at debug: they are not for this coordinator.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import socket
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

from mlxcel.cluster.errors import IdentityRejected
from mlxcel.cluster.identity import PeerId, bind_identity
from mlxcel.cluster.ratelimit import RateLimitedLog, WarnClass, cluster_warnings
from mlxcel.cluster.secret import ClusterSecret
from mlxcel.cluster.sockets import family

from .wire import (
    BEACON_FORMAT_VERSION,
    BEACON_INTERVAL_S,
    BEACON_LABEL,
    BEACON_MAC_LEN,
    BEACON_MAGIC,
    BEACON_MAX_SKEW_S,
    BEACON_NONCE_LEN,
    MAX_BEACON_LEN,
    MAX_REPLAY_ENTRIES,
)

log = logging.getLogger("mlxcel.bringup.beacon")

_FIXED = struct.Struct(">4sBQ16s")  # magic, format version, timestamp ms, nonce
MAX_FIELD_LEN = {"mlxcel version": 64, "cluster name": 64, "address": 255}


@dataclass(frozen=True)
class Beacon:
    """A parsed beacon (not yet verified)."""

    timestamp_ms: int
    nonce: bytes
    mlxcel: str
    cluster: str
    address: str  # as advertised: "ip:port"


class BeaconRejected(Exception):
    """A beacon this coordinator does not use; ``warn_class`` is the warning class it is logged in."""

    def __init__(self, message: str, warn_class: WarnClass = WarnClass.DIAGNOSTIC) -> None:
        super().__init__(message)
        self.warn_class = warn_class


class OtherCluster(Exception):
    """A valid beacon of another cluster name: ignored (debug), not an attack."""


def _mac(secret: ClusterSecret, signed: bytes) -> bytes:
    return hmac.new(secret.reveal(), BEACON_LABEL + signed, hashlib.sha256).digest()


def _field(name: str, text: str) -> bytes:
    raw = text.encode("ascii")
    if not 1 <= len(raw) <= MAX_FIELD_LEN[name]:
        raise ValueError(f"beacon {name} must be 1..{MAX_FIELD_LEN[name]} ASCII bytes")
    return bytes([len(raw)]) + raw


def encode_beacon(secret: ClusterSecret, *, mlxcel: str, cluster: str, address: PeerId,
                  timestamp_ms: int | None = None, nonce: bytes | None = None) -> bytes:
    """One beacon datagram (a fresh nonce and the current time unless given)."""
    ts = int(time.time() * 1000) if timestamp_ms is None else timestamp_ms
    nonce = os.urandom(BEACON_NONCE_LEN) if nonce is None else nonce
    if len(nonce) != BEACON_NONCE_LEN:
        raise ValueError(f"beacon nonce must be {BEACON_NONCE_LEN} bytes")
    signed = (_FIXED.pack(BEACON_MAGIC, BEACON_FORMAT_VERSION, ts, nonce) + _field("mlxcel version", mlxcel)
              + _field("cluster name", cluster) + _field("address", str(address)))
    return signed + _mac(secret, signed)


def parse_beacon(data: bytes) -> tuple[Beacon, bytes, bytes]:
    """(beacon, signed bytes, MAC) of a datagram; ``BeaconRejected`` (noise) when malformed."""
    def malformed(why: str) -> BeaconRejected:
        return BeaconRejected(f"malformed discovery beacon ({why})", WarnClass.NOISE)

    if len(data) > MAX_BEACON_LEN or len(data) < _FIXED.size + 3 + BEACON_MAC_LEN:
        raise malformed(f"{len(data)} bytes")
    magic, version, ts, nonce = _FIXED.unpack_from(data)
    if magic != BEACON_MAGIC:
        raise malformed("bad magic")
    if version != BEACON_FORMAT_VERSION:
        raise BeaconRejected(f"discovery beacon of format version {version}; this node reads version "
                             f"{BEACON_FORMAT_VERSION} (every node must run the same mlxcel version)")
    fields, off = [], _FIXED.size
    for name in MAX_FIELD_LEN:
        n = data[off] if off < len(data) else 0
        raw = data[off + 1: off + 1 + n]
        if n == 0 or len(raw) != n:
            raise malformed(f"bad {name} field")
        try:
            fields.append(raw.decode("ascii"))
        except UnicodeDecodeError:
            raise malformed(f"{name} is not ASCII") from None
        off += 1 + n
    if len(data) - off != BEACON_MAC_LEN:
        raise malformed("bad length")
    return Beacon(ts, nonce, *fields), data[:off], data[off:]


class BeaconVerifier:
    """The coordinator's checks; remembers accepted nonces for the skew window (replays)."""

    def __init__(self, secret: ClusterSecret, *, mlxcel: str, cluster: str,
                 max_skew_s: float = BEACON_MAX_SKEW_S, clock: Callable[[], float] = time.time,
                 max_entries: int = MAX_REPLAY_ENTRIES) -> None:
        self._secret, self.mlxcel, self.cluster = secret, mlxcel, cluster
        self.max_skew_s, self._clock, self._max_entries = max_skew_s, clock, max_entries
        self._seen: OrderedDict[bytes, float] = OrderedDict()  # nonce -> when it stops counting

    def verify(self, data: bytes, source_ip: str) -> PeerId:
        """The peer's assignment listener address, or ``BeaconRejected`` / ``OtherCluster``."""
        beacon, signed, mac = parse_beacon(data)
        if not hmac.compare_digest(_mac(self._secret, signed), mac):
            raise BeaconRejected(f"discovery beacon from {source_ip} does not verify under the cluster secret "
                                 "(forged, or sent by a node holding another secret)")
        if beacon.mlxcel != self.mlxcel:
            raise BeaconRejected(f"discovery beacon from {source_ip} comes from mlxcel {beacon.mlxcel}, this node "
                                 f"runs {self.mlxcel}; every node of a cluster must run the same mlxcel version")
        if beacon.cluster != self.cluster:
            raise OtherCluster(f"discovery beacon from {source_ip} is for cluster {beacon.cluster!r}")
        now = self._clock()
        skew = now - beacon.timestamp_ms / 1000
        if abs(skew) > self.max_skew_s:
            raise BeaconRejected(f"discovery beacon from {source_ip} is {abs(skew):.0f}s off this node's clock "
                                 f"(more than {self.max_skew_s:g}s: stale, or a clock to set right)")
        self._expire(now)
        if beacon.nonce in self._seen:
            raise BeaconRejected(f"discovery beacon from {source_ip} replays a beacon accepted within the last "
                                 f"{self.max_skew_s:g}s")
        try:
            peer = bind_identity(PeerId.parse(beacon.address), source_ip)
        except ValueError:
            raise BeaconRejected(f"discovery beacon from {source_ip} advertises {beacon.address!r}, "
                                 "not an ip:port address") from None
        except IdentityRejected:
            raise BeaconRejected(f"discovery beacon from {source_ip} advertises {beacon.address}, which is not "
                                 "its source address (mis-sourced)") from None
        if peer.port == 0:
            raise BeaconRejected(f"discovery beacon from {source_ip} advertises port 0")
        self._seen[beacon.nonce] = now + self.max_skew_s
        while len(self._seen) > self._max_entries:
            self._seen.popitem(last=False)
        return peer

    def _expire(self, now: float) -> None:
        while self._seen:
            nonce, until = next(iter(self._seen.items()))
            if until > now:
                return
            del self._seen[nonce]


class BeaconListener:
    """The coordinator's UDP socket on the discovery port (all interfaces)."""

    def __init__(self, verifier: BeaconVerifier, port: int, *, host: str = "0.0.0.0",
                 warnings: RateLimitedLog | None = None) -> None:
        self.verifier = verifier
        self.warnings = warnings or cluster_warnings
        self.sock = socket.socket(family(host), socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host, port))
        except OSError:
            self.sock.close()
            raise
        self.port = self.sock.getsockname()[1]

    def receive(self, timeout: float) -> PeerId | None:
        """One datagram within ``timeout``: the peer it announces, or None (nothing usable)."""
        self.sock.settimeout(max(timeout, 0.001))
        try:
            data, addr = self.sock.recvfrom(MAX_BEACON_LEN + 1)
        except socket.timeout:
            return None
        try:
            return self.verifier.verify(data, addr[0])
        except BeaconRejected as exc:
            self.warnings.warning(exc.warn_class, "%s", exc)
        except OtherCluster as exc:
            log.debug("%s; ignored", exc)
        return None

    def collect(self, want: int, window_s: float, *, settle_s: float, stop: threading.Event | None = None) -> list[PeerId]:
        """Distinct peers announced within ``window_s``, in the order first seen; stops ``settle_s``
        after the ``want``-th (so an extra peer beaconing at the same time is seen too)."""
        deadline = time.monotonic() + window_s
        peers: list[PeerId] = []
        while time.monotonic() < deadline and not (stop is not None and stop.is_set()):
            peer = self.receive(min(0.25, deadline - time.monotonic()))
            if peer is not None and peer not in peers:
                peers.append(peer)
                log.info("discovered peer %s", peer)
                if len(peers) == want:
                    deadline = min(deadline, time.monotonic() + settle_s)
        return peers

    def close(self) -> None:
        self.sock.close()


class BeaconSender:
    """A peer's beacons: one per ``interval_s`` to ``target``:``port`` while not paused."""

    def __init__(self, secret: ClusterSecret, *, mlxcel: str, cluster: str, address: PeerId,
                 target: str, port: int, interval_s: float = BEACON_INTERVAL_S) -> None:
        self._secret, self.mlxcel, self.cluster, self.address = secret, mlxcel, cluster, address
        self.target, self.port, self.interval_s = target, port, interval_s
        self.sock = socket.socket(family(target), socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
        if not address.ip.is_unspecified and family(address.host) == family(target):
            self.sock.bind((address.host, 0))  # the source IP is the advertised one
        self._active = threading.Event()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mlxcel-beacon", daemon=True)
        self.sent = 0
        self._warned = False

    def start(self) -> None:
        self._active.set()
        self._thread.start()

    def pause(self) -> None:
        """Stop beaconing (the assignment is committed)."""
        self._active.clear()

    def resume(self) -> None:
        """Beacon again (the peer went back to waiting)."""
        self._active.set()

    def _run(self) -> None:
        while not self._closed.is_set():
            if self._active.is_set():
                self._send_one()
            self._closed.wait(self.interval_s)

    def _send_one(self) -> None:
        data = encode_beacon(self._secret, mlxcel=self.mlxcel, cluster=self.cluster, address=self.address)
        try:
            self.sock.sendto(data, (self.target, self.port))
            self.sent += 1
        except OSError as exc:
            if not self._warned:
                log.warning("cannot send a discovery beacon to %s:%d: %s", self.target, self.port,
                            exc.strerror or type(exc).__name__)
                self._warned = True

    def close(self) -> None:
        self._closed.set()
        if self._thread.is_alive():
            self._thread.join(2.0)
        self.sock.close()
