"""Discovery beacons: pure encode/verify (the documented vector, every rejection in its warning
class), the rate-limited warnings, and the sender and listener over UDP on loopback (never a
broadcast address)."""

from __future__ import annotations

import logging
import re
import socket
import time
from pathlib import Path

import pytest

from mlxcel.bringup.beacon import (
    BeaconListener,
    BeaconRejected,
    BeaconSender,
    BeaconVerifier,
    OtherCluster,
    encode_beacon,
    parse_beacon,
)
from mlxcel.cluster.identity import PeerId
from mlxcel.cluster.ratelimit import RateLimitedLog, WarnClass
from mlxcel.cluster.secret import ClusterSecret

DOC = Path(__file__).resolve().parents[2] / "docs" / "bringup.md"
SECRET = ClusterSecret(b"mlxcel bring-up test vector secret")
OTHER = ClusterSecret(b"another cluster's secret, 32 bytes")
NOW = 1_800_000_000.0
PEER = PeerId.of("127.0.0.3", 19001)


def verifier(clock=lambda: NOW) -> BeaconVerifier:
    return BeaconVerifier(SECRET, mlxcel="0.1.0", cluster="mlxcel-cluster", clock=clock)


def beacon(secret: ClusterSecret = SECRET, *, ts: float = NOW, nonce: bytes = b"\x01" * 16, mlxcel: str = "0.1.0",
           cluster: str = "mlxcel-cluster", address: PeerId = PEER) -> bytes:
    return encode_beacon(secret, mlxcel=mlxcel, cluster=cluster, address=address, timestamp_ms=int(ts * 1000),
                         nonce=nonce)


def doc_vectors() -> dict[str, str]:
    block = re.search(r"```beacon-vector\n(.*?)```", DOC.read_text(), re.S)
    assert block, "docs/bringup.md lost its beacon-vector block"
    return {k.strip(): v.strip() for k, v in (line.split("=", 1) for line in block.group(1).splitlines() if line.strip())}


def test_the_documented_beacon_vector():
    v = doc_vectors()
    secret = ClusterSecret(bytes.fromhex(v["secret"]))
    data = encode_beacon(secret, mlxcel=v["mlxcel"], cluster=v["cluster"], address=PeerId.parse(v["address"]),
                         timestamp_ms=int(v["timestamp_ms"]), nonce=bytes.fromhex(v["nonce"]))
    assert data.hex() == v["beacon"]
    parsed, signed, mac = parse_beacon(data)
    assert (parsed.cluster, parsed.address, mac.hex()) == (v["cluster"], v["address"], v["beacon"][-64:])
    assert BeaconVerifier(secret, mlxcel=v["mlxcel"], cluster=v["cluster"],
                          clock=lambda: int(v["timestamp_ms"]) / 1000).verify(data, "192.0.2.11") == PeerId.parse(v["address"])


def test_a_valid_beacon_names_the_peer_listener():
    assert verifier().verify(beacon(), "127.0.0.3") == PEER
    # an unspecified advertised IP takes the datagram's source (a peer listening on 0.0.0.0)
    assert verifier().verify(beacon(address=PeerId.of("0.0.0.0", 40123)), "127.0.0.7") == PeerId.of("127.0.0.7", 40123)


@pytest.mark.parametrize("name,data,source,message", [
    ("forged", beacon(OTHER), "127.0.0.3", "does not verify under the cluster secret"),
    ("altered", beacon()[:-40] + bytes([beacon()[-40] ^ 1]) + beacon()[-39:], "127.0.0.3", "does not verify"),
    ("version", beacon(mlxcel="0.0.9"), "127.0.0.3", "comes from mlxcel 0.0.9, this node runs 0.1.0"),
    ("stale", beacon(ts=NOW - 61), "127.0.0.3", "is 61s off this node's clock"),
    ("future", beacon(ts=NOW + 61), "127.0.0.3", "is 61s off this node's clock"),
    ("mis-sourced", beacon(), "127.0.0.5", "advertises 127.0.0.3:19001, which is not its source address"),
    ("port 0", beacon(address=PeerId.of("127.0.0.3", 0)), "127.0.0.3", "advertises port 0"),
])
def test_typed_rejections_are_diagnostic(name, data, source, message):
    with pytest.raises(BeaconRejected, match=message) as info:
        verifier().verify(data, source)
    assert info.value.warn_class is WarnClass.DIAGNOSTIC


def test_a_replay_within_the_window_is_rejected():
    v = verifier()
    data = beacon()
    assert v.verify(data, "127.0.0.3") == PEER
    with pytest.raises(BeaconRejected, match="replays a beacon accepted within the last 60s"):
        v.verify(data, "127.0.0.3")
    assert v.verify(beacon(nonce=b"\x02" * 16), "127.0.0.3") == PEER  # the next beacon has a fresh nonce


def test_a_rejected_beacon_does_not_poison_the_replay_cache():
    """A copy sent first from another address is mis-sourced; the peer's own beacon still counts."""
    v = verifier()
    with pytest.raises(BeaconRejected, match="mis-sourced"):
        v.verify(beacon(), "127.0.0.5")
    assert v.verify(beacon(), "127.0.0.3") == PEER


def test_the_replay_cache_forgets_after_the_window():
    clock = [NOW]
    v = verifier(lambda: clock[0])
    v.verify(beacon(), "127.0.0.3")
    clock[0] += 59
    v.verify(beacon(ts=NOW + 59, nonce=b"\x03" * 16), "127.0.0.3")
    clock[0] += 2  # the first nonce has expired (its beacon would be stale now anyway)
    v.verify(beacon(ts=NOW + 61, nonce=b"\x04" * 16), "127.0.0.3")
    assert list(v._seen) == [b"\x03" * 16, b"\x04" * 16]


@pytest.mark.parametrize("data", [b"", b"junk" * 10, b"MLXB" + b"\x01" + b"\x00" * 60, beacon()[:-1], beacon() + b"x",
                                  b"XLXB" + beacon()[4:], b"x" * 600])
def test_malformed_datagrams_are_noise(data):
    with pytest.raises(BeaconRejected) as info:
        verifier().verify(data, "127.0.0.3")
    assert info.value.warn_class is WarnClass.NOISE


def test_another_format_version_is_diagnostic():
    data = bytearray(beacon())
    data[4] = 2
    with pytest.raises(BeaconRejected, match="format version 2") as info:
        verifier().verify(bytes(data), "127.0.0.3")
    assert info.value.warn_class is WarnClass.DIAGNOSTIC


def test_another_cluster_is_ignored():
    with pytest.raises(OtherCluster):
        verifier().verify(beacon(cluster="lab-b"), "127.0.0.3")


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_rejections_are_rate_limited_per_class_over_udp(caplog):
    clock = Clock()
    warnings = RateLimitedLog(logging.getLogger("mlxcel.test.beacons"), clock=clock)
    listener = BeaconListener(BeaconVerifier(SECRET, mlxcel="0.1.0", cluster="mlxcel-cluster"), 0,
                              host="127.0.0.1", warnings=warnings)
    sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sender.bind(("127.0.0.3", 0))

        def send(data: bytes) -> None:
            sender.sendto(data, ("127.0.0.1", listener.port))
            assert listener.receive(5) is None

        with caplog.at_level(logging.DEBUG, "mlxcel.test.beacons"):
            for i in range(7):  # forged: the diagnostic budget is 5 per minute
                send(encode_beacon(OTHER, mlxcel="0.1.0", cluster="mlxcel-cluster", address=PEER))
            send(b"junk")  # the noise class has its own budget
            clock.t += 61
            send(encode_beacon(OTHER, mlxcel="0.1.0", cluster="mlxcel-cluster", address=PEER))
        records = [(r.levelno, r.getMessage()) for r in caplog.records]
    finally:
        sender.close()
        listener.close()
    levels = [lvl for lvl, _ in records]
    assert levels == [logging.WARNING] * 5 + [logging.DEBUG] * 2 + [logging.WARNING] * 3
    assert "does not verify" in records[0][1] and "malformed discovery beacon" in records[7][1]
    assert records[8][1] == ("2 cluster warnings (diagnostic) were logged at debug during the 60s window that "
                             "ended 1s ago")


def test_sender_and_listener_on_loopback():
    listener = BeaconListener(verifier(clock=time.time), 0, host="127.0.0.1")
    sender = BeaconSender(SECRET, mlxcel="0.1.0", cluster="mlxcel-cluster", address=PEER, target="127.0.0.1",
                          port=listener.port, interval_s=0.1)
    try:
        sender.start()
        assert listener.collect(1, 5, settle_s=0.3) == [PEER]  # several beacons, one peer
        assert sender.sent >= 2
        sender.pause()
        time.sleep(0.3)
        paused = sender.sent
        time.sleep(0.3)
        assert sender.sent == paused
        sender.resume()
        assert listener.collect(1, 5, settle_s=0.0) == [PEER]
    finally:
        sender.close()
        listener.close()
