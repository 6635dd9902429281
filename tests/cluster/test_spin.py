"""Polling before sleeping (``MLXCEL_SPIN_US``, mlxcel/spin.py): the window, the two polls over real sockets and
threads, and a transport whose readers poll, which must deliver and refuse exactly what a sleeping one does."""

from __future__ import annotations

import queue
import socket
import threading
import time

import pytest

from mlxcel.cluster.wire import Kind
from mlxcel.spin import poll_get, poll_recv_into, spin_window_s

from .conftest import CLIENT_IP, SERVER_IP, Inbox, RawClient, assert_serves

WINDOW_S = 0.05


def test_the_window_comes_from_the_environment_within_bounds(monkeypatch, make_transport):
    from mlxcel.cli import build_parser
    from mlxcel.commands.serve import check_flags
    from mlxcel.errors import CLIError

    monkeypatch.delenv("MLXCEL_SPIN_US", raising=False)
    assert spin_window_s() == 0 and make_transport(SERVER_IP).options.spin_s == 0  # off by default
    monkeypatch.setenv("MLXCEL_SPIN_US", "250")
    assert spin_window_s() == 0.00025
    started = make_transport(CLIENT_IP)
    monkeypatch.setenv("MLXCEL_SPIN_US", "0")
    assert started.options.spin_s == 0.00025  # read once, when the transport started
    assert make_transport(CLIENT_IP, spin_s=0.001).options.spin_s == 0.001  # an option wins
    args = build_parser().parse_args(["serve", "-m", "anything"])
    for bad, words in (("2ms", "a whole number of microseconds, not '2ms'"), ("100001", "from 0 to 100000, not 100001"),
                       ("-1", "from 0 to 100000, not -1")):
        monkeypatch.setenv("MLXCEL_SPIN_US", bad)
        with pytest.raises(ValueError, match=f"MLXCEL_SPIN_US must be {words}"):
            spin_window_s()
        with pytest.raises(CLIError, match="MLXCEL_SPIN_US must be"):
            check_flags(args)  # mlxcel serve refuses it before it loads or binds anything


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def test_poll_recv_into_takes_bytes_that_arrive_within_the_window(pair):
    a, b = pair
    view = memoryview(bytearray(16))
    threading.Timer(WINDOW_S / 5, a.sendall, (b"hello",)).start()
    assert poll_recv_into(b, view, 5.0) == 5 and bytes(view[:5]) == b"hello"


def test_poll_recv_into_gives_up_after_the_window_and_sees_eof(pair):
    a, b = pair
    view = memoryview(bytearray(16))
    t0 = time.perf_counter()
    assert poll_recv_into(b, view, WINDOW_S) is None  # nothing came: the caller sleeps in recv
    assert time.perf_counter() - t0 >= WINDOW_S
    assert b.gettimeout() is None  # still a blocking socket
    a.close()
    assert poll_recv_into(b, view, WINDOW_S) == 0  # EOF


def test_poll_get_polls_then_waits():
    q: queue.SimpleQueue = queue.SimpleQueue()
    threading.Timer(WINDOW_S / 5, q.put, ("early",)).start()
    assert poll_get(q, 5.0) == "early"  # within the window
    threading.Timer(3 * WINDOW_S, q.put, ("late",)).start()
    assert poll_get(q, WINDOW_S) == "late"  # after the window: the blocking get
    q.put("now")
    assert poll_get(q, 0) == "now"  # no window: a plain get
    t0 = time.perf_counter()
    with pytest.raises(queue.Empty):
        poll_get(q, WINDOW_S, timeout=WINDOW_S)  # the window, then the timeout
    assert time.perf_counter() - t0 >= 2 * WINDOW_S


@pytest.fixture
def polling_server(make_transport) -> tuple[object, Inbox]:
    inbox = Inbox()
    t = make_transport(SERVER_IP, handshake_timeout=1.0, spin_s=WINDOW_S)
    t.serve(inbox.on_message, inbox.on_request)
    return t, inbox


def test_a_polling_reader_takes_a_frame_in_pieces_then_refuses_a_tampered_one(polling_server, secret, raw_clients):
    srv, inbox = polling_server
    raw = RawClient(srv, secret, CLIENT_IP).handshake()
    raw_clients.append(raw)
    frame = raw.seal(Kind.TENSOR_DATA, b"activation" * 10)
    raw.send(frame[:7])  # the header in two pieces: the reader polls between them
    time.sleep(WINDOW_S / 5)
    raw.send(frame[7:])
    assert bytes(inbox.get().payload) == b"activation" * 10
    time.sleep(2 * WINDOW_S)  # the reader has given up polling and sleeps in recv
    raw.send(raw.seal(Kind.CONTROL, b"after a sleep"))
    assert bytes(inbox.get().payload) == b"after a sleep"
    tampered = bytearray(raw.seal(Kind.TENSOR_DATA, b"A" * 64))
    tampered[-1] ^= 1
    raw.send(bytes(tampered))
    assert raw.closed_by_peer()  # refused as a sleeping reader refuses it
    assert inbox.q.empty()
    assert_serves(srv, secret)


def test_polling_transports_carry_rpcs_and_a_fragmented_message(polling_server, make_transport):
    srv, inbox = polling_server
    client = make_transport(CLIENT_IP, spin_s=WINDOW_S)
    for i in range(20):
        assert bytes(client.request(srv.identity, b"n%d" % i, timeout=5)) == b"echo:n%d" % i
    body = bytes(range(256)) * 4096 + b"tail"  # 1 MiB and more: many frames
    client.send(srv.identity, Kind.TENSOR_DATA, body)
    got = inbox.get()
    assert bytes(got.payload) == body
