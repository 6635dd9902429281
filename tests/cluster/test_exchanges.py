"""The shared pieces behind the coordinator (and the router to come): the exchange table and the peer monitor."""

from __future__ import annotations

import threading
import collections
import time

from mlxcel.cluster.exchanges import ExchangeTable
from mlxcel.cluster.health import PeerMonitor
from mlxcel.cluster.identity import PeerId

A, B = PeerId.parse("127.0.0.3:19001"), PeerId.parse("127.0.0.4:19002")


def _table(**kw) -> ExchangeTable:
    return ExchangeTable(lambda ex: TimeoutError(f"{ex.nonce} expired"), tick_s=0.01, **kw)


def test_an_exchange_resolves_once_and_runs_its_continuation_once():
    table, seen = _table(), []
    ex = table.open(5, senders=(A,), then=lambda e: seen.append((e.reply, e.error)))
    assert table.is_open(ex.nonce) and ex.accepts(A) and not ex.accepts(B)
    assert table.resolve(ex, reply="first")
    assert not table.resolve(ex, reply="second") and table.get(ex.nonce) is None
    assert seen == [("first", None)] and ex.event.is_set()


def test_nonces_are_fresh_and_unpredictable():
    table = _table()
    nonces = {table.open(5).nonce for _ in range(1000)}
    assert len(nonces) == 1000 and all(len(n) == 16 and int(n, 16) >= 0 for n in nonces)


def test_the_ticker_fails_an_exchange_at_its_absolute_deadline():
    ticks, table = [], None
    table = _table(on_tick=ticks.append)
    table.start()
    try:
        ex = table.open(0.1)
        start = time.monotonic()
        assert ex.event.wait(2)
        assert isinstance(ex.error, TimeoutError) and 0.09 <= time.monotonic() - start < 1.0
        assert ticks and not table.is_open(ex.nonce)
    finally:
        table.close(lambda ex: RuntimeError("closed"))


def test_wait_times_out_and_forgets_so_a_late_answer_finds_nothing():
    table = _table()
    ex = table.open(60)
    assert not table.wait(ex, 0.05)
    assert table.get(ex.nonce) is None and not table.resolve(ex, reply="late")


def test_a_resolution_racing_the_waiter_timeout_is_not_lost():
    table = _table()
    for _ in range(200):
        ex = table.open(60)
        threading.Thread(target=table.resolve, args=(ex,), kwargs={"reply": "ok"}).start()
        if table.wait(ex, 0.001):
            assert ex.reply == "ok"


def test_close_fails_every_open_exchange():
    table = _table()
    exs = [table.open(60) for _ in range(3)]
    table.close(lambda ex: RuntimeError("closing"))
    assert all(isinstance(ex.error, RuntimeError) for ex in exs) and len(table) == 0 and table.closing


class Probes:
    """A scripted peer side: each probe is answered by what the test says, when it says."""

    def __init__(self):
        self.pending: dict[PeerId, list] = collections.defaultdict(list)
        self.sent: list[PeerId] = []

    def __call__(self, peer, answered):
        self.sent.append(peer)
        self.pending[peer].append(answered)

    def answer(self, peer, state=None, why=""):
        self.pending[peer].pop(0)(state, why)


def _monitor(probes, events, check=lambda peer, state: None):
    return PeerMonitor([A, B], interval_s=1.0, probe=probes, check=check,
                       on_up=lambda p, returned: events.append(("up", p, returned)),
                       on_down=lambda p, why: events.append(("down", p, why)),
                       on_restart=lambda p: events.append(("restart", p)))


def test_peers_go_up_down_and_come_back_once_per_outage():
    probes, events = Probes(), []
    mon = _monitor(probes, events)
    assert mon.down() == [A, B]
    mon.beat(0.0)
    probes.answer(A, {"boot_id": "1"})
    probes.answer(B, {"boot_id": "2"})
    assert mon.down() == [] and events == [("up", A, False), ("up", B, False)]
    mon.beat(0.5)  # before the interval: no probe
    assert probes.sent == [A, B]
    mon.beat(1.0)
    probes.answer(A, None, "no answer")
    mon.lost(A, "again")  # a second failure in the same outage is not a second event
    probes.answer(B, {"boot_id": "2"})
    assert mon.down() == [A] and events[2:] == [("down", A, "no answer"), ("up", B, False)]
    mon.beat(2.0)
    probes.answer(A, {"boot_id": "1"})
    assert events[-1] == ("up", A, True) and mon.is_up(A)


def test_no_new_probe_while_one_is_outstanding():
    probes, events = Probes(), []
    mon = _monitor(probes, events)
    mon.beat(0.0)
    mon.beat(1.0)
    mon.beat(2.0)
    assert probes.sent == [A, B]  # a dead peer's probe waits out its own deadline


def test_a_new_boot_id_is_a_restart_before_it_is_up():
    probes, events = Probes(), []
    mon = _monitor(probes, events)
    mon.beat(0.0)
    probes.answer(A, {"boot_id": "1"})
    mon.beat(1.0)
    probes.answer(A, {"boot_id": "9"})
    assert events[-2:] == [("restart", A), ("up", A, False)]


def test_a_peer_that_comes_back_as_something_else_stays_down():
    probes, events = Probes(), []

    def check(peer, state):
        if state.get("model") != "m":
            raise ValueError("another model")

    mon = _monitor(probes, events, check)
    mon.beat(0.0)
    probes.answer(A, {"model": "m"})
    mon.beat(1.0)
    probes.answer(A, {"model": "other"})
    assert not mon.is_up(A) and events[-1][0] == "down" and "another model" in events[-1][2]


def test_a_failed_probe_of_a_peer_never_up_is_silent():
    probes, events = Probes(), []
    mon = _monitor(probes, events)
    mon.beat(0.0)
    probes.answer(A, None, "refused")
    assert events == [] and mon.down() == [A, B]


def test_a_replaced_peer_is_watched_at_its_new_address_and_the_old_ones_answers_are_ignored():
    probes, events = Probes(), []
    mon = _monitor(probes, events)
    mon.beat(0.0)
    probes.answer(B, {"boot_id": "2"})
    c = PeerId.parse("127.0.0.5:19003")
    mon.replace(A, c)  # a spare took A's place while A's probe was out
    assert list(mon.status) == [c, B] and mon.down() == [c]  # in A's place, down until it answers
    probes.answer(A, {"boot_id": "1"})  # the old address's late answer changes nothing
    mon.lost(A, "gone")
    assert mon.down() == [c] and events == [("up", B, False)]
    mon.beat(1.0)
    probes.answer(c, {"boot_id": "3"})
    assert mon.down() == [] and events[-1] == ("up", c, False)
