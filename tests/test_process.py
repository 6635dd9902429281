"""``mlxcel.process``: a stop asked for before a role's HTTP server took the signals over ends that server as
soon as it has started (a signal's ``KeyboardInterrupt`` can be dropped by Python, e.g. inside an import)."""

from __future__ import annotations

import socket
import threading

import pytest

from mlxcel.process import STOP_REQUESTED, Endpoint, ExitSwitch, http_server

pytestmark = pytest.mark.timeout(60)


async def _app(scope, receive, send) -> None:  # a minimal ASGI app with a lifespan
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return


@pytest.fixture
def endpoint():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    yield Endpoint(sock, log_level="warning")
    sock.close()


def _serve(endpoint: Endpoint) -> tuple[ExitSwitch, threading.Thread]:
    switch = ExitSwitch()
    server = http_server(_app, switch, endpoint)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [endpoint.sock]}, daemon=True)
    thread.start()
    return switch, thread


def test_a_stop_asked_for_before_serving_ends_the_server_once_it_has_started(endpoint):
    STOP_REQUESTED.set()
    try:
        switch, thread = _serve(endpoint)
        thread.join(20)
        alive = thread.is_alive()
        if alive:
            switch.stop()
            thread.join(20)
        assert not alive, "the server kept serving after a stop asked for before it started"
        assert switch.server.started and switch.exit_code() == 0  # a clean exit, as for a signal while serving
    finally:
        STOP_REQUESTED.clear()


def test_without_a_stop_the_server_serves_until_stopped(endpoint):
    switch, thread = _serve(endpoint)
    try:
        with socket.create_connection(endpoint.address, timeout=10):
            pass  # it accepts
        thread.join(1)
        assert thread.is_alive()
    finally:
        switch.stop()
        thread.join(20)
    assert not thread.is_alive() and switch.exit_code() == 0
