"""A flood of junk on a peer's assignment port does not starve an honest coordinator: one source can
hold at most 4 of the listener's 8 pending slots, and junk bytes are dropped at once."""

from __future__ import annotations

import select
import socket
import threading
import time

import httpx
import pytest

from mlxcel.cluster.identity import PeerId

pytestmark = [pytest.mark.timeout(240), pytest.mark.proc]


class Flood:
    """Source A keeps 16 silent connections open (redialling each one the peer closes: the excess at
    accept, the 4 it admits after the 5 s handshake timeout); source B
    connects, sends junk and closes, about 200 times a second."""

    def __init__(self, target: PeerId, staller: str, junker: str) -> None:
        self.target, self.staller, self.junker = target, staller, junker
        self.stop = threading.Event()
        self.junk_sent = 0
        self.redials = 0
        self.threads = [threading.Thread(target=self._stall, daemon=True), threading.Thread(target=self._junk, daemon=True)]

    def __enter__(self) -> "Flood":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(10)

    def _dial(self, source: str) -> socket.socket | None:
        s = socket.socket()
        try:
            s.bind((source, 0))
            s.connect(self.target.address)
            return s
        except OSError:
            s.close()
            return None

    def _stall(self) -> None:
        held = [s for s in (self._dial(self.staller) for _ in range(16)) if s is not None]
        while not self.stop.wait(0.01):  # redial about 100 times a second at most: a flood, not a CPU hog
            ready, _, _ = select.select(held, [], [], 0) if held else ([], [], [])
            for s in ready:  # closed by the peer: at accept (pool full) or after the 5 s handshake timeout
                held.remove(s)
                s.close()
                fresh = self._dial(self.staller)
                if fresh is not None:
                    held.append(fresh)
                    self.redials += 1
        for s in held:
            s.close()

    def _junk(self) -> None:
        while not self.stop.wait(0.005):  # ~200 connections a second, leaving the two cores to the cluster
            s = self._dial(self.junker)
            if s is None:
                continue
            try:
                s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" * 4)
                self.junk_sent += 1
            except OSError:
                pass
            finally:
                s.close()


def test_a_flood_of_junk_does_not_starve_an_honest_coordinator(bringup):
    peer = bringup.peer("peer", "127.0.0.3")
    with Flood(PeerId.parse(peer.listener), staller="127.0.0.6", junker="127.0.0.7") as flood:
        peer.wait_for(r"pending handshake pool full \(8 in flight, 4 per source\); closed a connection from 127\.0\.0\.6")
        started = time.monotonic()
        coord = bringup.coordinator("coord", 1, "--cluster-peers", peer.listener)
        coord.wait_for(r"model tiny ready", timeout=90)
        assert time.monotonic() - started < 45  # within the push window, not starved
        body = {"model": "tiny", "prompt": [1, 40, 41], "max_tokens": 3, "temperature": 0, "ignore_eos": True}
        assert httpx.post(f"{coord.url}/v1/completions", json=body, timeout=60).status_code == 200
        assert flood.redials > 0 and flood.junk_sent > 0
    peer.wait_for(r"activated as stage-0")
