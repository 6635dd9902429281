"""Cluster security and transport: secret, handshake, protected frames, transport.

Module map (one concept each; the protocol core is sans-I/O):

- ``errors``     one exception base, local/remote branches
- ``wire``       protocol constants (PROTOCOL_VERSION 5, suites, kinds, caps)
- ``secret``     secret sources, precedence, validation; ``ClusterSecret``
- ``identity``   ``PeerId`` and identity binding to the TCP source IP
- ``keys``       HKDF-SHA256 directional frame keys
- ``handshake``  client/server handshake state machines (bytes in, bytes out)
- ``frames``     frame sealer/opener and the bounded incremental reader
- ``messages``   message kinds, fragmentation and reassembly over frames
- ``ratelimit``  the four rate-limited warning classes
- ``transport``  blocking sockets, thread per connection: ``Transport``

See docs/protocol.md for the wire format.
"""

from .errors import ClusterError, LocalError, RemoteError
from .identity import PeerId
from .messages import Message
from .secret import ClusterSecret, load_secret
from .transport import StreamWriter, Transport, TransportOptions
from .wire import PROTOCOL_VERSION, Channel, Kind, Suite

__all__ = [
    "PROTOCOL_VERSION",
    "Channel",
    "ClusterError",
    "ClusterSecret",
    "Kind",
    "LocalError",
    "Message",
    "PeerId",
    "RemoteError",
    "StreamWriter",
    "Suite",
    "Transport",
    "TransportOptions",
    "load_secret",
]
