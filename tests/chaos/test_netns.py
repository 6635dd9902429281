"""The chaos lab's network namespaces (tests/chaos/netns.py): a cut link drops traffic, and nothing outlives it."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from tests.chaos import netns

pytestmark = [pytest.mark.proc, pytest.mark.timeout(120)]
PORT = 5555
ECHO = ("import socket, sys\ns = socket.create_server((sys.argv[1], int(sys.argv[2])))\nprint('up', flush=True)\n"
        "while True:\n    c, _ = s.accept(); c.sendall(b'hi'); c.close()\n")
CONNECT = "import socket, sys\nprint(socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1.5).recv(2))"


@pytest.fixture
def lab():
    why = netns.unusable()
    if why:
        pytest.skip(why)
    lab = netns.Lab(2)
    try:
        yield lab
    finally:
        lab.close()


def _reaches(lab: netns.Lab, host: int | None, address: str) -> bool:
    """Whether a TCP connection from host ``host`` (None: this machine) to ``address`` gets the greeting."""
    prefix = [] if host is None else lab.prefix(host)
    done = subprocess.run([*prefix, sys.executable, "-c", CONNECT, address, str(PORT)], capture_output=True, text=True)
    return done.stdout.strip() == "b'hi'"


def test_a_cut_link_drops_traffic_both_ways_and_comes_back(lab: netns.Lab) -> None:
    server = subprocess.Popen([*lab.prefix(0), sys.executable, "-c", ECHO, lab.addresses[0], str(PORT)],
                              stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None and server.stdout.readline().strip() == "up"
    assert _reaches(lab, 1, lab.addresses[0]) and _reaches(lab, None, lab.addresses[0])
    with pytest.raises(OSError):  # this machine's namespace has no such address: the hosts are elsewhere
        socket.create_server((lab.addresses[0], PORT)).close()
    lab.link(0, False)
    assert not _reaches(lab, 1, lab.addresses[0]) and not _reaches(lab, None, lab.addresses[0])
    lab.link(0, True)
    time.sleep(0.3)
    assert _reaches(lab, 1, lab.addresses[0])
    lab.close()  # ends the server in the namespace, by pid
    assert server.wait(10) == -9
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(space in listed for space in [*lab.spaces, lab.hub]), listed
    assert subprocess.run(["ip", "link", "show", "dev", lab.host_link], capture_output=True).returncode != 0
