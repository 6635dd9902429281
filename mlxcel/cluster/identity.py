"""Peer identities (advertised listener addresses) and pending-pool source keys."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Union

from .errors import IdentityRejected

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def canonical_ip(host: str) -> IPAddress:
    """Parse an IP literal; an IPv4-mapped IPv6 address becomes IPv4."""
    ip = ipaddress.ip_address(host.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


@dataclass(frozen=True, slots=True, order=True)
class PeerId:
    """A node's identity: the canonical IP and port of its advertised listener."""

    host: str
    port: int

    @classmethod
    def parse(cls, text: str) -> "PeerId":
        """Parse ``a.b.c.d:port`` or ``[v6]:port`` (numeric IPs only)."""
        if not isinstance(text, str):
            raise ValueError("identity must be a string")
        if text.startswith("["):
            host, sep, port = text[1:].partition("]:")
        else:
            host, sep, port = text.rpartition(":")
            if ":" in host:
                raise ValueError(f"IPv6 identity must be bracketed: {text!r}")
        if not sep or not port.isdigit() or len(port) > 5:
            raise ValueError(f"not a host:port socket address: {text!r}")
        return cls.of(host, int(port))

    @classmethod
    def of(cls, host: str, port: int) -> "PeerId":
        """Build from an IP literal and a port, canonicalising the IP."""
        if not 0 <= port <= 65535:
            raise ValueError(f"port out of range: {port}")
        return cls(str(canonical_ip(host)), port)

    @property
    def ip(self) -> IPAddress:
        return ipaddress.ip_address(self.host)

    @property
    def address(self) -> tuple[str, int]:
        """The (host, port) tuple ``socket.connect`` takes."""
        return (self.host, self.port)

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def bind_identity(advertised: PeerId, source_ip: str) -> PeerId:
    """The identity a connection is attributed to: the advertised address whose IP
    must be the TCP source IP (an unspecified advertised IP takes the source IP)."""
    source = canonical_ip(source_ip)
    if advertised.ip.is_unspecified:
        return PeerId(str(source), advertised.port)
    if advertised.ip != source:
        raise IdentityRejected(
            f"refusing to bind a listener address the peer does not own: it advertised {advertised}, "
            f"the connection comes from {source}"
        )
    return advertised


def source_key(ip: str) -> str:
    """Pending-pool source: an IPv4 address, or the /64 of an IPv6 address."""
    addr = canonical_ip(ip)
    if isinstance(addr, ipaddress.IPv6Address):
        return str(ipaddress.IPv6Network((int(addr) >> 64 << 64, 64)))
    return str(addr)


PeerLike = Union["PeerId", str, tuple]


def as_peer(peer: PeerLike) -> PeerId:
    """Accept a PeerId, ``"host:port"`` or ``(host, port)``."""
    if isinstance(peer, PeerId):
        return peer
    if isinstance(peer, str):
        return PeerId.parse(peer)
    host, port = peer[0], peer[1]
    return PeerId.of(host, int(port))
