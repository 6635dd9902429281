"""A local tensor-parallel group's ring ports (mlxcel/parallel/launch.py): below the ephemeral range, distinct."""

from __future__ import annotations

import socket

from mlxcel.parallel import launch


def test_ring_ports_are_distinct_free_and_below_the_ephemeral_range():
    ports = launch.free_ports(8)
    low, high = launch.LOCAL_PORTS
    assert len(set(ports)) == 8 and all(low <= p < min(high, launch._ephemeral_floor()) for p in ports)
    for p in ports:  # free: each binds now
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_taken_port_is_skipped(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        monkeypatch.setattr(launch, "_candidates", lambda low, high, count: [taken, taken + 1 if taken < 65535 else 1])
        monkeypatch.setattr(launch, "LOCAL_PORTS", (1, 65536))
        monkeypatch.setattr(launch, "_ephemeral_floor", lambda: 65536)
        [port] = launch.free_ports(1)
        assert port != taken


def test_without_a_low_range_the_kernel_picks(monkeypatch):
    monkeypatch.setattr(launch, "_ephemeral_floor", lambda: 5_000)  # no room below the floor
    ports = launch.free_ports(3)
    assert len(set(ports)) == 3 and all(p > 0 for p in ports)
