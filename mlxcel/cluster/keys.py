"""Per-connection directional frame keys (HKDF-SHA256, docs/protocol.md "Keys")."""

from __future__ import annotations

from dataclasses import dataclass

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from .secret import ClusterSecret
from .wire import KEY_LEN, NONCE_LEN, Channel, hkdf_info


@dataclass(frozen=True, slots=True)
class DirectionalKeys:
    """The two 32-byte keys of one connection; repr never shows them."""

    c2s: bytes
    s2c: bytes

    def __repr__(self) -> str:
        return "DirectionalKeys(<redacted>)"

    def for_client(self) -> tuple[bytes, bytes]:
        """(send key, receive key) of the connecting side."""
        return self.c2s, self.s2c

    def for_server(self) -> tuple[bytes, bytes]:
        """(send key, receive key) of the accepting side."""
        return self.s2c, self.c2s


def _hkdf(ikm: bytes, salt: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=KEY_LEN, salt=salt, info=info).derive(ikm)


def derive_keys(secret: ClusterSecret, client_nonce: bytes, server_nonce: bytes, channel: Channel) -> DirectionalKeys:
    """HKDF-SHA256: IKM = secret, salt = client nonce || server nonce,
    info = ``mlxcel-cluster-frame-v1/<channel>/c2s`` and ``.../s2c``."""
    if len(client_nonce) != NONCE_LEN or len(server_nonce) != NONCE_LEN:
        raise ValueError(f"nonces must be {NONCE_LEN} bytes")
    salt = client_nonce + server_nonce
    ikm = secret.reveal()
    return DirectionalKeys(
        c2s=_hkdf(ikm, salt, hkdf_info(channel, "c2s")),
        s2c=_hkdf(ikm, salt, hkdf_info(channel, "s2c")),
    )
