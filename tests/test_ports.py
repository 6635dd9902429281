"""The test-port helper: ports below the kernel's ephemeral range, in this worker's block, never twice."""

from __future__ import annotations

import socket

from tests.ports import HIGH, LOW, _block, free_port, free_ports


def ephemeral_floor() -> int:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        return int(f.read().split()[0])


def test_ports_lie_below_the_ephemeral_range_in_this_workers_block():
    ports = free_ports(50, "127.0.0.2", "127.0.0.3")
    assert len(set(ports)) == 50
    assert all(p in _block() and LOW <= p < HIGH < ephemeral_floor() for p in ports)


def test_a_port_in_use_on_any_named_host_is_never_handed_out():
    with socket.socket() as held:
        held.bind(("127.0.0.3", free_port("127.0.0.3")))
        taken = held.getsockname()[1]
        for _ in range(200):
            port = free_port("127.0.0.2", "127.0.0.3", avoid=(taken + 1,))
            assert port not in (taken, taken + 1)
            with socket.socket() as s:
                s.bind(("127.0.0.3", port))  # free where it was said to be
