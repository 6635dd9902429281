"""Reading a file that holds a secret (the cluster secret, API keys): its bytes, a warning if others may read it."""

from __future__ import annotations

import logging
import stat
from pathlib import Path


def read_private_file(path: Path, what: str, source: str, error: type[Exception], log: logging.Logger) -> bytes:
    """The bytes of ``path``; ``error`` naming ``what`` and ``source`` when it cannot be read, and a
    warning on ``log`` (never the contents) when the group or others may read it."""
    try:
        st = path.stat()
        raw = path.read_bytes()
    except OSError as exc:
        raise error(f"cannot read {what} {source}: {exc.strerror or type(exc).__name__}") from None
    if st.st_mode & (stat.S_IRGRP | stat.S_IROTH):
        log.warning("%s %s is group- or world-readable (mode %04o); restrict it with chmod 600",
                    what, path, stat.S_IMODE(st.st_mode))
    return raw
