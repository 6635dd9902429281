"""The secret (and derived keys, and payload bytes) never reach reprs, errors or logs."""

from __future__ import annotations

import logging
import traceback

import pytest

from mlxcel.cluster.errors import ClusterError
from mlxcel.cluster.handshake import ClientHandshake, ServerHandshake
from mlxcel.cluster.keys import derive_keys
from mlxcel.cluster.wire import Channel, Kind, Suite

from .conftest import CLIENT_IP, OTHER_BYTES, SECRET_BYTES, RawClient, wait_until

pytestmark = pytest.mark.timeout(60)

PAYLOAD_MARK = b"PAYLOAD-MARKER-do-not-log"


def _needles(secret) -> list[str]:
    raw = [SECRET_BYTES, OTHER_BYTES]
    keys = derive_keys(secret, bytes(32), bytes(32), Channel.TRANSPORT)
    raw += [keys.c2s, keys.s2c]
    out = []
    for r in raw:
        out += [r.decode("latin-1"), r.hex(), repr(r)[2:-1]]
    out += [SECRET_BYTES.decode()[:16], PAYLOAD_MARK.decode()]
    return out


def _assert_clean(texts: list[str], needles: list[str]) -> None:
    for text in texts:
        for needle in needles:
            assert needle not in text, f"leak in: {text[:200]}"


def test_reprs(secret):
    objs = [
        secret,
        ClientHandshake(secret, "127.0.0.1:1"),
        ServerHandshake(secret, "127.0.0.1"),
        derive_keys(secret, bytes(32), bytes(32), Channel.TRANSPORT),
    ]
    _assert_clean([repr(o) for o in objs] + [str(o) for o in objs], _needles(secret))


def test_logs_and_errors_during_failures(server, make_transport, secret, other_secret, raw_clients, caplog):
    srv, inbox = server
    errors: list[BaseException] = []
    with caplog.at_level(logging.DEBUG):
        # wrong secret, suite mismatch, identity not owned
        for kw, ip in (({"sec": other_secret}, CLIENT_IP), ({"suite": Suite.HMAC_SHA256}, CLIENT_IP), ({"bind_outbound": False}, "127.0.0.7")):
            sec = kw.pop("sec", None)
            t = make_transport(ip, sec, **kw)
            try:
                t.send(srv.identity, Kind.TENSOR_DATA, PAYLOAD_MARK)
            except ClusterError as exc:
                errors.append(exc)
        # a tampered frame whose payload carries the marker
        raw = RawClient(srv, secret).handshake()
        raw_clients.append(raw)
        frame = bytearray(raw.seal(Kind.TENSOR_DATA, PAYLOAD_MARK))
        frame[-1] ^= 1
        raw.send(bytes(frame))
        assert raw.closed_by_peer()
        assert wait_until(lambda: any("failed authentication" in r.getMessage() for r in caplog.records))
    assert len(errors) == 3
    texts = [r.getMessage() for r in caplog.records] + [str(r.args) for r in caplog.records]
    texts += ["".join(traceback.format_exception(e)) for e in errors]
    _assert_clean(texts, _needles(secret))
    assert inbox.q.empty()
