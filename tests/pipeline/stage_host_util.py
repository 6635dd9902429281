"""Waiting for and stopping the host processes of the family tables (``stage_host``, ``role_host``)."""

from __future__ import annotations

import subprocess
import threading


def first_line(proc: subprocess.Popen, timeout: float) -> str:
    """The first line the process prints on stdout, or "" if none comes within ``timeout``."""
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
    reader.start()
    reader.join(timeout)
    return got[0].strip() if got else ""


def stop(proc: subprocess.Popen) -> None:
    """Close its stdin (the host's signal to stop), then kill it if it does not exit."""
    if proc.poll() is None:
        try:
            proc.stdin.close()  # type: ignore[union-attr]
            proc.wait(20)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait(10)
