"""Supervise one node without systemd: a detached process, its pidfile, its log, readiness by URL.

``start`` runs the command in a new session (setsid) with stdout and stderr appended to the log
and its pid in the pidfile, then waits until the readiness URL answers 200; it fails at once,
with the log's last lines, when the process exits first. A node that already runs is left alone,
unless a file it read at start-up (or its command line) changed since: then it is restarted.
``stop`` signals the session (SIGTERM, SIGKILL after the grace period). A pidfile whose process is
gone (or is another program) is stale and ignored; a node whose pidfile was lost is found by its
command line (``NodeSpec.match``). Every function returns one JSON-ready dict; ``failed`` marks a
failure and ``changed`` whether anything was started or stopped.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator

from mlxcel.node.spec import NodeSpec

POLL_S = 0.1
READY_PROBE_TIMEOUT_S = 2.0
TAIL_LINES = 15
COMMAND_KEY = "command line"  # the inputs entry that stands for the command, environment and directory


# ---------------------------------------------------------------------------
# Processes


def running_pid(spec: NodeSpec) -> int | None:
    """This node's process: the pidfile's, else one whose command line has ``match`` and the program."""
    pid = _read_pid(spec.pidfile)
    if pid is not None and _has(_settled_command_line(pid) or "", spec.match):
        return pid
    for pid, command in _processes():
        if _has(command, spec.match) and _has(command, spec.command[0]) and pid != os.getpid():
            return pid
    return None


def _has(command: str, words: str) -> bool:
    """``words`` in ``command`` on word boundaries ("--port 80" is not in "--port 8080")."""
    return f" {words} " in f" {command} "


def _read_pid(pidfile: Path) -> int | None:
    try:
        return int(pidfile.read_text().strip())
    except (OSError, ValueError):
        return None


def _command_line(pid: int) -> str | None:
    """The live (not zombie) process's command line, space-joined; None when it is gone."""
    if Path("/proc/self").exists():
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            raw = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, IndexError):
            return None
        return None if state == "Z" else raw.rstrip(b"\0").replace(b"\0", b" ").decode(errors="replace")
    out = subprocess.run(["ps", "-o", "stat=,command=", "-p", str(pid)], capture_output=True, text=True).stdout
    stat_, _, command = out.strip().partition(" ")
    return None if not stat_ or stat_.startswith("Z") else command.strip()


def _settled_command_line(pid: int, wait_s: float = 0.5) -> str | None:
    """As ``_command_line``, but waits out the moment after exec when /proc shows an empty command line."""
    deadline = time.monotonic() + wait_s
    while (command := _command_line(pid)) == "" and time.monotonic() < deadline:
        time.sleep(0.01)
    return command


def _processes() -> Iterator[tuple[int, str]]:
    """(pid, command line) of every live process."""
    if Path("/proc/self").exists():
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and (command := _command_line(int(entry.name))) is not None:
                yield int(entry.name), command
        return
    listing = subprocess.run(["ps", "-eo", "pid=,stat=,command="], capture_output=True, text=True).stdout
    for line in listing.splitlines():
        pid_text, stat_, command = (line.strip().split(None, 2) + ["", ""])[:3]
        if pid_text.isdigit() and not stat_.startswith("Z"):
            yield int(pid_text), command


def _alive(pid: int) -> bool:
    return _command_line(pid) is not None


# ---------------------------------------------------------------------------
# Inputs: what the node was started with


def input_digests(spec: NodeSpec) -> dict[str, str]:
    """SHA-256 of the command line (with environment and directory) and of each input file (missing: empty)."""
    run = json.dumps([list(spec.command), spec.environment, str(spec.directory)], sort_keys=True)
    digests = {COMMAND_KEY: hashlib.sha256(run.encode()).hexdigest()}
    for path in spec.inputs:
        try:
            digests[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
        except OSError:
            digests[str(path)] = hashlib.sha256(b"").hexdigest()
    return digests


def fingerprint(spec: NodeSpec) -> str:
    """One digest over ``input_digests``: 16 hex digits that change whenever a restart is due."""
    return hashlib.sha256(json.dumps(input_digests(spec), sort_keys=True).encode()).hexdigest()[:16]


def changed_inputs(spec: NodeSpec) -> list[str]:
    """Inputs that differ from those the running node was started with (all of them when unknown)."""
    current = input_digests(spec)
    try:
        recorded = json.loads(spec.inputs_file.read_text())
    except (OSError, ValueError):
        return list(current)
    if not isinstance(recorded, dict):
        return list(current)
    return [name for name, digest in current.items() if recorded.get(name) != digest]


# ---------------------------------------------------------------------------
# Commands


def launch(spec: NodeSpec) -> dict:
    """Start the node unless it runs (no readiness wait)."""
    pid = running_pid(spec)
    if pid is not None:
        return {"changed": False, "pid": pid, "msg": f"{spec.name} already running"}
    spec.pidfile.parent.mkdir(parents=True, exist_ok=True)
    spec.log.parent.mkdir(parents=True, exist_ok=True)
    with open(spec.log, "ab") as log:
        log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} mlxcel node start\n".encode())
        log.flush()
        try:
            proc = subprocess.Popen(list(spec.command), cwd=spec.directory, env={**os.environ, **spec.environment},
                                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True, close_fds=True)
        except OSError as exc:
            return {"failed": True, "changed": False, "pid": None,
                    "msg": f"{spec.name}: cannot run {spec.command[0]}: {exc.strerror or exc}"}
    _write_atomically(spec.inputs_file, json.dumps(input_digests(spec)) + "\n")
    _write_atomically(spec.pidfile, f"{proc.pid}\n")
    return {"changed": True, "pid": proc.pid, "msg": f"{spec.name} started"}


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def stop(spec: NodeSpec) -> dict:
    """SIGTERM to the node's session, SIGKILL after ``stop_grace_s``; a stale pidfile is removed."""
    pid = running_pid(spec)
    if pid is None:
        spec.pidfile.unlink(missing_ok=True)
        return {"changed": False, "pid": None, "msg": f"{spec.name} not running"}
    _signal(pid, signal.SIGTERM)
    killed = not _wait_gone(pid, spec.stop_grace_s)
    if killed:
        _signal(pid, signal.SIGKILL)
        _wait_gone(pid, None)
    spec.pidfile.unlink(missing_ok=True)
    how = f"killed (SIGKILL after {spec.stop_grace_s:g} s)" if killed else "stopped"
    return {"changed": True, "pid": pid, "killed": killed, "msg": f"{spec.name} {how}"}


def _signal(pid: int, sig: signal.Signals) -> None:
    """The whole session when ``pid`` leads its process group (as started here), else the process."""
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _wait_gone(pid: int, timeout_s: float | None) -> bool:
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while _alive(pid):
        if deadline is not None and time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)
    return True


def probe(url: str) -> tuple[int | None, dict | str]:
    """HTTP status and body of ``url`` (parsed when JSON); None and the reason when nothing answers."""
    context = ssl._create_unverified_context()  # a liveness probe of our own node, not a trust decision
    try:
        with urllib.request.urlopen(url, timeout=READY_PROBE_TIMEOUT_S, context=context) as resp:
            return resp.status, _body(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, _body(err.read())
    except (OSError, ValueError) as err:
        return None, str(getattr(err, "reason", err))


def _body(raw: bytes) -> dict | str:
    try:
        return json.loads(raw or b"{}")
    except ValueError:
        return raw[:200].decode(errors="replace")


def status(spec: NodeSpec) -> dict:
    """pid (None when not running), the inputs changed since its start and what the readiness URL answers."""
    pid = running_pid(spec)
    code, body = probe(spec.ready_url) if spec.ready_url else (None, "no readiness URL")
    return {"changed": False, "node": spec.name, "pid": pid, "url": spec.ready_url, "http_status": code,
            "health": body, "changed_inputs": changed_inputs(spec) if pid is not None else []}


def wait_ready(spec: NodeSpec, timeout_s: float | None = None) -> dict:
    """Wait until the readiness URL answers 200; fail at once, with the log's tail, if the process exits."""
    timeout_s = spec.ready_timeout_s if timeout_s is None else timeout_s
    deadline = time.monotonic() + timeout_s
    while True:
        pid = running_pid(spec)
        if pid is None:
            return {"failed": True, "pid": None,
                    "msg": f"{spec.name} exited during start-up; last lines of {spec.log}:\n{tail(spec.log)}"}
        if spec.ready_url is None:
            return {"pid": pid, "msg": f"{spec.name} running"}
        code, body = probe(spec.ready_url)
        if code == 200:
            return {"pid": pid, "health": body, "msg": f"{spec.name} ready"}
        if time.monotonic() > deadline:
            return {"failed": True, "pid": pid,
                    "msg": f"{spec.name}: {spec.ready_url} not ready after {timeout_s:g} s (last: {code} {body}); "
                           f"last lines of {spec.log}:\n{tail(spec.log)}"}
        time.sleep(POLL_S)


def start(spec: NodeSpec, *, wait: bool = True, timeout_s: float | None = None) -> dict:
    """Start unless running, restart if an input changed since its start; then wait for readiness."""
    changed = changed_inputs(spec) if running_pid(spec) is not None else []
    if changed:
        stop(spec)
    started = launch(spec)
    if started.get("failed") or not wait:
        return {**started, "restarted": bool(changed), "changed_inputs": changed}
    ready = wait_ready(spec, timeout_s)
    msg = started["msg"] if not changed else f"{spec.name} restarted ({', '.join(changed)} changed)"
    if ready.get("failed"):
        msg = ready["msg"]
    return {**ready, "changed": started["changed"], "restarted": bool(changed), "changed_inputs": changed,
            "msg": msg}


def restart(spec: NodeSpec, *, wait: bool = True, timeout_s: float | None = None) -> dict:
    """Stop (if running), start, wait for readiness."""
    stop(spec)
    result = start(spec, wait=wait, timeout_s=timeout_s)
    return {**result, "changed": True}


def tail(log: Path, lines: int = TAIL_LINES) -> str:
    """The log's last lines ("(no log)" when there is none)."""
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
