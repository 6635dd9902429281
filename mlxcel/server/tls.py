"""TLS on the HTTP port: ``--ssl-certfile`` / ``--ssl-keyfile``, checked before binding, served by uvicorn.

uvicorn builds its own SSLContext from the two paths; loading them here first turns a wrong path,
a malformed PEM or a key that does not match the certificate into one line before anything listens.
"""

from __future__ import annotations

import argparse
import logging
import ssl
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxcel.errors import CLIError

log = logging.getLogger("mlxcel.server.tls")


class TLSError(CLIError):
    """A certificate or key problem, phrased for the operator."""


@dataclass(frozen=True)
class TLSConfig:
    certfile: Path
    keyfile: Path

    def uvicorn_options(self) -> dict[str, Any]:
        return {"ssl_certfile": str(self.certfile), "ssl_keyfile": str(self.keyfile)}


def add_tls_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument("--ssl-certfile", metavar="PATH", default=None,
                        help="PEM certificate (chain) to serve HTTPS with; needs --ssl-keyfile")
    parser.add_argument("--ssl-keyfile", metavar="PATH", default=None,
                        help="PEM private key of --ssl-certfile (unencrypted; keep it mode 0600)")


def load_tls(certfile: str | None, keyfile: str | None) -> TLSConfig | None:
    """None without TLS flags; otherwise both files checked by loading them as a server context would."""
    if certfile is None and keyfile is None:
        return None
    if certfile is None or keyfile is None:
        raise TLSError("--ssl-certfile and --ssl-keyfile go together: pass both or neither")
    cert, key = Path(certfile).expanduser(), Path(keyfile).expanduser()
    for path, flag in ((cert, "--ssl-certfile"), (key, "--ssl-keyfile")):
        if not path.is_file():
            raise TLSError(f"cannot read {flag} {path}: no such file")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(cert, key, password=_no_password)
    except _EncryptedKey:
        raise TLSError(f"the TLS key {key} is encrypted; pass an unencrypted key (mode 0600)") from None
    except (ssl.SSLError, OSError) as exc:
        raise TLSError(f"cannot load the TLS certificate {cert} with key {key}: {_reason(exc)}") from None
    mode = key.stat().st_mode
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        log.warning("the TLS key file %s is group- or world-readable (mode %04o); restrict it with chmod 600",
                    key, stat.S_IMODE(mode))
    return TLSConfig(certfile=cert, keyfile=key)


class _EncryptedKey(Exception):
    pass


def _no_password() -> bytes:
    """Called only for an encrypted key, which would otherwise prompt on the terminal (uvicorn gets no password)."""
    raise _EncryptedKey


def _reason(exc: ssl.SSLError | OSError) -> str:
    reason = getattr(exc, "reason", None)
    if reason == "KEY_VALUES_MISMATCH":
        return "the key does not match the certificate"
    if reason is not None or isinstance(exc, ssl.SSLError):
        return "not a PEM certificate and matching private key"
    return exc.strerror or type(exc).__name__
