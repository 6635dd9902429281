"""SIGINT and SIGTERM end a real ``--pp-auto`` coordinator promptly and cleanly, in every phase.

The peers are in-process ``FakePeer`` agents (real sockets and handshake) that stall at one step, so
the coordinator is blocked where the signal lands: on a pending read of the push (exit 130 at once,
not after the 10 s frame window), or, after a successful push, waiting for stages that never start
(exit 0, as any server; it used to die of SIGTERM with rc -15).
"""

from __future__ import annotations

import signal
import time

import pytest

from tests.bringup.fake_peers import FakePeer

pytestmark = [pytest.mark.timeout(180), pytest.mark.proc]

PROMPT_S = 5.0  # generous on a loaded 2-core box; a read of the push waits up to 10 s


@pytest.fixture
def fakes(bringup):
    made: list[FakePeer] = []

    def make(host: str, **kw) -> FakePeer:
        peer = FakePeer(bringup.tmp, host, bringup.model, bringup.secret, **kw)
        made.append(peer)
        return peer

    yield make
    for peer in made:
        peer.close()


def _signal_and_time(coord, sig: int) -> tuple[int, float]:
    start = time.monotonic()
    coord.proc.send_signal(sig)
    code = coord.wait_exit(60)
    return code, time.monotonic() - start


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_during_a_pending_read_of_the_push_exits_130_at_once(bringup, fakes, sig):
    peer = fakes("127.0.0.3", stall="query")
    coord = bringup.coordinator("coord", 1, "--cluster-peers", str(peer.address))
    assert peer.queried.wait(120), coord.text  # the coordinator now waits for the info frame
    time.sleep(0.3)
    code, took = _signal_and_time(coord, sig)
    assert code == 130, coord.text
    assert took < PROMPT_S, f"exited {took:.1f}s after the signal:\n{coord.text}"
    assert "mlxcel: interrupted" in coord.text and "Traceback" not in coord.text
    assert not (coord.cwd / ".mlxcel").exists()


def test_sigterm_in_the_commit_phase_exits_130_at_once(bringup, fakes):
    peer = fakes("127.0.0.3", stall="commit")
    coord = bringup.coordinator("coord", 1, "--cluster-peers", str(peer.address))
    assert peer.committing.wait(120), coord.text
    time.sleep(0.3)
    code, took = _signal_and_time(coord, signal.SIGTERM)
    assert code == 130 and took < PROMPT_S, f"rc {code} after {took:.1f}s:\n{coord.text}"
    assert not (coord.cwd / ".mlxcel").exists()  # its own commit comes after every peer's


@pytest.mark.parametrize("serving", [False, True], ids=["starting", "waiting"])
def test_sigterm_while_waiting_for_the_stages_exits_0(bringup, fakes, serving):
    peer = fakes("127.0.0.3")  # activated, but it starts no stage: the coordinator waits for it
    coord = bringup.coordinator("coord", 1, "--cluster-peers", str(peer.address))
    coord.wait_for(r"assigned stage-0 = ", 120)  # starting: the coordinator role loads before it serves
    if serving:
        coord.wait_for(r"Application startup complete", 120)
        time.sleep(1)
    assert coord.alive, coord.text  # still waiting for stage-0 (startup_s is 60 s)
    code, took = _signal_and_time(coord, signal.SIGTERM)
    assert code == 0, f"rc {code}:\n{coord.text}"
    assert took < 15, coord.text
    assert "Traceback" not in coord.text and "cannot join stage" not in coord.text
