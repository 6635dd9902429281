"""Beacon bring-up through the real CLI (beacons to 127.0.0.1 only): forged, stale, foreign-version,
replayed and mis-sourced beacons are rejected in the rate-limited diagnostic class, junk in the noise
class, and two peers (one with a fixed address, one on an OS-assigned port) are assigned and serve a
streamed chat equal to a single node."""

from __future__ import annotations

import socket
import time
import tomllib

import pytest

from mlxcel import __version__
from mlxcel.bringup.beacon import encode_beacon
from mlxcel.cluster.identity import PeerId
from mlxcel.cluster.secret import ClusterSecret, load_secret
from tests.bringup.conftest import chat_text
from tests.bringup.procs import free_port

pytestmark = [pytest.mark.timeout(240), pytest.mark.proc]


def _send(data: bytes, source: str, port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((source, 0))
        s.sendto(data, ("127.0.0.1", port))


def test_beacon_bring_up_rejects_bad_beacons(bringup, single_node_chat):
    udp = free_port("0.0.0.0", kind=socket.SOCK_DGRAM)
    mdns = ("--cluster-discovery", "mdns", "--cluster-discovery-port", str(udp))
    coord = bringup.coordinator("coord", 2, *mdns)
    coord.wait_for(rf"listening for 2 peer beacons on UDP port {udp}")

    fixed = PeerId.of("127.0.0.3", free_port("127.0.0.3"))  # the first peer's address, known in advance
    secret = load_secret(bringup.secret)

    def beacon(key: ClusterSecret = secret, **kw) -> bytes:
        fields = {"mlxcel": __version__, "cluster": "mlxcel-cluster", "address": fixed, **kw}
        return encode_beacon(key, **fields)

    genuine = beacon()
    _send(beacon(ClusterSecret(b"not the cluster's secret at all")), "127.0.0.3", udp)
    _send(beacon(timestamp_ms=int((time.time() - 120) * 1000)), "127.0.0.3", udp)
    _send(beacon(mlxcel="0.0.1"), "127.0.0.3", udp)
    _send(genuine, "127.0.0.3", udp)  # accepted: it names the real peer's address
    _send(genuine, "127.0.0.3", udp)  # the same datagram again
    _send(beacon(), "127.0.0.5", udp)  # advertises 127.0.0.3 from 127.0.0.5
    _send(b"not a beacon", "127.0.0.5", udp)
    for text in ("does not verify under the cluster secret", "is 120s off this node's clock",
                 "comes from mlxcel 0.0.1", "replays a beacon accepted within the last 60s",
                 "advertises 127.0.0.3:\\d+, which is not its source address \\(mis-sourced\\)"):
        coord.wait_for(rf"WARNING mlxcel\.cluster: discovery beacon from 127\.0\.0\.[35] {text}")
    coord.wait_for(r"WARNING mlxcel\.cluster: malformed discovery beacon \(\d+ bytes\)")
    _send(beacon(ClusterSecret(b"not the cluster's secret at all")), "127.0.0.3", udp)  # the 6th: debug only

    target = ("--cluster-discovery-target", "127.0.0.1")
    first = bringup.peer("first", "127.0.0.3", *mdns, *target, port=fixed.port)
    second = bringup.peer("second", None, *mdns, *target)  # no address: 0.0.0.0 and an OS-assigned port
    port = PeerId.parse(second.listener).port
    assert second.listener == f"0.0.0.0:{port}"
    coord.wait_for(r"model tiny ready")
    assert chat_text(coord.url, stream=True) == single_node_chat
    assert coord.text.count("WARNING mlxcel.cluster: discovery beacon") == 5  # the class's budget per minute

    # beacons to 127.0.0.1 leave an unbound socket from 127.0.0.1: that is the second peer's stage address
    doc = tomllib.loads((coord.cwd / ".mlxcel" / "cluster.toml").read_text())
    assert [(n["id"], n["address"]) for n in doc["nodes"][1:]] == [("stage-0", f"127.0.0.1:{port}"),
                                                                 ("stage-1", str(fixed))]
    first.wait_for(r"activated as stage-1")
    second.wait_for(rf"stage stage-0 \(layers 0-1\) on cluster address 127\.0\.0\.1:{port}")
