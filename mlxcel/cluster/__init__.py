"""Cluster security and transport: secret, handshake, protected frames, transport.

Module map (one concept each; the protocol core is sans-I/O):

- ``errors``     one exception base, local/remote branches
- ``wire``       protocol constants (PROTOCOL_VERSION 5, suites, kinds, caps)
- ``secret``     secret sources, precedence, validation; ``ClusterSecret``
- ``identity``   ``PeerId`` and identity binding to the TCP source IP
- ``keys``       HKDF-SHA256 directional frame keys
- ``handshake``  client/server handshake state machines (bytes in, bytes out)
- ``frames``     frame sealer/opener
- ``reader``     frame reading off a socket
- ``messages``   message kinds, fragmentation and reassembly over frames
- ``ratelimit``  the four rate-limited warning classes
- ``rpc``        response waiters, typed RPC errors
- ``aead_pipeline``  sealing and opening a large message's chunks on helper threads beside the socket copy
- ``options``    ``TransportOptions``: every bound and default of a transport
- ``sockets``    socket options of every connection
- ``socket_handshake``  the handshake machines driven over a blocking socket
- ``connection`` one connection: reader thread, RPC waiters, ``StreamWriter``
- ``listener``   accept loop, pending-handshake pool, admission
- ``pool``       dialler with backoff, pooled outbound connections (per peer and lane)
- ``transport``  ``Transport``: one node (listener + pool), the public API
- ``outbox``     one sender thread per transport: replies and forwards queued off the reader threads
- ``exchanges``  nonce -> waiter table with absolute deadlines and an expected sender
- ``health``     ``PeerMonitor``: probes, up/down, boot ids

See docs/protocol.md for the wire format.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# The re-exports load on first use (PEP 562): importing a light submodule (``mlxcel.cluster.wire``,
# ``mlxcel.cluster.identity``) must not pull in the transport's numpy and cryptography, which cost
# about 0.7 s of CPU per process (``mlxcel node``, ``mlxcel --help``: ``python -X importtime``).
_EXPORTS = {
    "ClusterError": "errors", "LocalError": "errors", "RemoteError": "errors", "RequestError": "errors",
    "RequestFailed": "errors",
    "PeerId": "identity",
    "Message": "messages",
    "ClusterSecret": "secret", "load_secret": "secret",
    "StreamWriter": "transport", "Transport": "transport", "TransportOptions": "transport",
    "PROTOCOL_VERSION": "wire", "Channel": "wire", "ErrorCode": "wire", "Kind": "wire", "Suite": "wire",
}

if TYPE_CHECKING:
    from .errors import ClusterError, LocalError, RemoteError, RequestError, RequestFailed
    from .identity import PeerId
    from .messages import Message
    from .secret import ClusterSecret, load_secret
    from .transport import StreamWriter, Transport, TransportOptions
    from .wire import PROTOCOL_VERSION, Channel, ErrorCode, Kind, Suite


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


__all__ = [
    "PROTOCOL_VERSION",
    "Channel",
    "ClusterError",
    "ClusterSecret",
    "ErrorCode",
    "Kind",
    "LocalError",
    "Message",
    "PeerId",
    "RemoteError",
    "RequestError",
    "RequestFailed",
    "StreamWriter",
    "Suite",
    "Transport",
    "TransportOptions",
    "load_secret",
]
