"""Supervise one node without systemd: a supervisor process, the node's pidfile, its log, readiness by URL.

``start`` runs ``mlxcel node supervise`` (``mlxcel/node/supervise.py``) in a new session (setsid)
with its output appended to the log; the supervisor runs the node's command as its child, in a
session of its own, with the node's pid in the pidfile, and restarts it when it dies
(``mlxcel/node/restart.py``). ``start`` then waits until the readiness URL answers 200; it fails at
once, with the log's last lines, when the node exits first on its first run. A node that already
runs is left alone, unless a file it read at start-up (or its command line) changed since, or it
runs without its supervisor: then it is restarted. ``stop`` stops the supervisor, which stops the
node (SIGTERM to its session, SIGKILL after the grace period), then anything left. A pidfile whose
process is gone (or is another program) is stale and ignored; a node whose pidfile was lost is found
by its command line (``NodeSpec.match``), a supervisor by ``node supervise --config <its TOML>``.
Every function returns one JSON-ready dict; ``failed`` marks a failure and ``changed`` whether
anything was started or stopped.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict
from pathlib import Path
from typing import Iterator

from mlxcel.config import ENV_NODE_STANDBY_FDS
from mlxcel.node.spec import NodeSpec
from mlxcel.node.state import FINAL, read_state

POLL_S = 0.1
READY_PROBE_TIMEOUT_S = 2.0
TAIL_LINES = 15
COMMAND_KEY = "command line"  # the inputs entry that stands for the command, environment and directory
SUPERVISION_KEY = "supervision"  # the inputs entry of a node that runs without its supervisor
SUPERVISOR_START_S = 15.0  # a new supervisor has started the node within this (Python start-up, one fork)
SUPERVISOR_STOP_EXTRA_S = 5.0  # a stopping supervisor gets the node's grace and this long


# ---------------------------------------------------------------------------
# Processes


def running_pid(spec: NodeSpec) -> int | None:
    """This node's process: the pidfile's, else one whose command line has ``match`` and the program."""
    pid = _read_pid(spec.pidfile)
    if pid is not None and _has(_settled_command_line(pid) or "", spec.match):
        return pid
    for pid, command in _processes():
        if _has(command, spec.match) and _has(command, spec.command[0]) and pid != os.getpid() \
                and not _is_standby(pid):
            return pid
    return None


def _is_standby(pid: int) -> bool:
    """A supervisor's standby has the node's command line: told apart by its environment (Linux; else never)."""
    try:
        return f"{ENV_NODE_STANDBY_FDS}=".encode() in Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False


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
    """SHA-256 of the command line (with environment, directory and restart policy) and of each input file
    (missing: empty)."""
    run = json.dumps([list(spec.command), spec.environment, str(spec.directory), asdict(spec.restart)], sort_keys=True)
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
# The supervisor process (mlxcel node supervise) and the node it runs


def spawn_node(spec: NodeSpec) -> subprocess.Popen:
    """Run the node's command in a session of its own, output appended to the log; record its pid and inputs."""
    proc = _popen_node(spec, {})
    record_started(spec, proc.pid)
    return proc


def record_started(spec: NodeSpec, pid: int) -> None:
    """``pid`` is the node now: the pidfile, and the inputs it reads as they are."""
    _write_atomically(spec.inputs_file, json.dumps(input_digests(spec)) + "\n")
    _write_atomically(spec.pidfile, f"{pid}\n")


def wants_standby(spec: NodeSpec) -> bool:
    """A warm standby serves only an mlxcel server (``mlxcel-server ...`` or ``mlxcel serve ...``) that restarts."""
    program = os.path.basename(spec.command[0])
    server = program == "mlxcel-server" or (program == "mlxcel" and spec.command[1:2] == ("serve",))
    return server and spec.restart.standby and spec.restart.policy == "on-failure"


def spawn_standby(spec: NodeSpec) -> tuple[subprocess.Popen, int, int]:
    """The node's command as a standby (``mlxcel/commands/standby.py``): the process, the write end of its
    go pipe and the (non-blocking) read end of its warm pipe."""
    go_r, go_w = os.pipe()
    warm_r, warm_w = os.pipe()
    try:
        proc = _popen_node(spec, {ENV_NODE_STANDBY_FDS: f"{go_r},{warm_w}"}, pass_fds=(go_r, warm_w))
    except OSError:
        for fd in (go_w, warm_r):
            os.close(fd)
        raise
    finally:
        os.close(go_r)
        os.close(warm_w)
    os.set_blocking(warm_r, False)
    return proc, go_w, warm_r


def _popen_node(spec: NodeSpec, env: dict[str, str], pass_fds: tuple[int, ...] = ()) -> subprocess.Popen:
    spec.pidfile.parent.mkdir(parents=True, exist_ok=True)
    spec.log.parent.mkdir(parents=True, exist_ok=True)
    with open(spec.log, "ab") as log:
        return subprocess.Popen(list(spec.command), cwd=spec.directory, env={**os.environ, **spec.environment, **env},
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, close_fds=True, pass_fds=pass_fds)


def supervisor_command(spec: NodeSpec) -> list[str]:
    """The supervisor's argv: this Python, ``-m mlxcel node supervise --config <the node TOML>``."""
    if spec.source is None:
        raise ValueError(f"{spec.name}: a node supervised by mlxcel node needs its node TOML (spec.source)")
    return [sys.executable, "-m", "mlxcel", "node", "supervise", "--config", str(spec.source)]


def supervisor_pid(spec: NodeSpec) -> int | None:
    """The live supervisor of this node: the state file's, else one whose command line names its TOML."""
    if spec.source is None:
        return None
    match = f"node supervise --config {spec.source}"
    recorded = read_state(spec.state_file)
    if recorded is not None and _has(_settled_command_line(recorded.supervisor_pid) or "", match):
        return recorded.supervisor_pid
    for pid, command in _processes():
        if _has(command, match) and pid != os.getpid():
            return pid
    return None


def launch(spec: NodeSpec) -> dict:
    """Start the node under its supervisor unless it runs or its supervisor is restarting it (no readiness wait)."""
    pid = running_pid(spec)
    if pid is not None:
        return {"changed": False, "pid": pid, "msg": f"{spec.name} already running"}
    if supervisor_pid(spec) is not None:
        return {"changed": False, "pid": None, "msg": f"{spec.name} is being restarted by its supervisor"}
    spec.pidfile.parent.mkdir(parents=True, exist_ok=True)
    spec.state_file.unlink(missing_ok=True)
    spec.pidfile.unlink(missing_ok=True)
    with open(spec.log, "ab") as log:
        log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} mlxcel node start\n".encode())
        log.flush()
        try:
            sup = subprocess.Popen(supervisor_command(spec), cwd=spec.directory, stdin=subprocess.DEVNULL,
                                   stdout=log, stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)
        except OSError as exc:
            return {"failed": True, "changed": False, "pid": None,
                    "msg": f"{spec.name}: cannot run its supervisor {sys.executable}: {exc.strerror or exc}"}
    return _first_spawn(spec, sup)


def _first_spawn(spec: NodeSpec, sup: subprocess.Popen) -> dict:
    """Wait until the new supervisor has started the node (its pid in the state file)."""
    deadline = time.monotonic() + SUPERVISOR_START_S
    while time.monotonic() < deadline:
        recorded = read_state(spec.state_file)
        if recorded is not None and recorded.supervisor_pid == sup.pid and (recorded.pid or recorded.state in FINAL):
            if recorded.pid:
                return {"changed": True, "pid": recorded.pid, "supervisor_pid": sup.pid, "msg": f"{spec.name} started"}
            break
        if sup.poll() is not None:
            break
        time.sleep(0.02)
    else:
        signal_session(sup.pid, signal.SIGKILL)
    recorded = read_state(spec.state_file)
    why = recorded.message if recorded is not None and recorded.supervisor_pid == sup.pid else "no node started"
    return {"failed": True, "changed": False, "pid": None,
            "msg": f"{spec.name}: its supervisor did not start it ({why}); last lines of {spec.log}:\n{tail(spec.log)}"}


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------
# Commands


def stop(spec: NodeSpec) -> dict:
    """Stop the supervisor (which stops the node: SIGTERM, SIGKILL after ``stop_grace_s``), then any node left."""
    node_pid = running_pid(spec)
    sup = supervisor_pid(spec)
    killed = False
    if sup is not None:
        try:
            os.kill(sup, signal.SIGTERM)
        except ProcessLookupError:
            pass
        if not _wait_gone(sup, spec.stop_grace_s + SUPERVISOR_STOP_EXTRA_S):
            signal_session(sup, signal.SIGKILL)
            _wait_gone(sup, None)
        recorded = read_state(spec.state_file)
        killed = bool(recorded and recorded.killed)
    left = running_pid(spec)  # none, unless the supervisor was gone or died before it stopped the node
    if left is not None:
        node_pid = left
        signal_session(left, signal.SIGTERM)
        killed = not _wait_gone(left, spec.stop_grace_s)
        if killed:
            signal_session(left, signal.SIGKILL)
            _wait_gone(left, None)
    spec.pidfile.unlink(missing_ok=True)
    if sup is None and node_pid is None:
        return {"changed": False, "pid": None, "msg": f"{spec.name} not running"}
    how = f"killed (SIGKILL after {spec.stop_grace_s:g} s)" if killed else "stopped"
    return {"changed": True, "pid": node_pid, "supervisor_pid": sup, "killed": killed, "msg": f"{spec.name} {how}"}


def signal_session(pid: int, sig: signal.Signals) -> None:
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


def stale_inputs(spec: NodeSpec) -> list[str]:
    """Why the running node is not as a start would leave it: its changed inputs, and ``supervision``
    when it runs without its supervisor (started by an older mlxcel, or its supervisor was killed)."""
    return changed_inputs(spec) + ([SUPERVISION_KEY] if supervisor_pid(spec) is None else [])


def supervision(spec: NodeSpec) -> dict:
    """What the supervisor recorded: its pid (None when none runs), state, restarts and the last cause."""
    recorded = read_state(spec.state_file)
    sup = supervisor_pid(spec)
    if recorded is None:
        return {"pid": sup, "state": None, "restarts": 0, "last_cause": None, "last_exit": None,
                "last_heal_s": None, "standby_pid": None, "standby_warm": False, "message": ""}
    state = recorded.state if sup is not None or recorded.state in FINAL else "gone"  # killed with SIGKILL
    standby = recorded.standby_pid if sup is not None else None
    return {"pid": sup, "state": state, "restarts": recorded.restarts, "last_cause": recorded.last_cause,
            "last_exit": recorded.last_exit, "last_heal_s": recorded.last_heal_s, "standby_pid": standby,
            "standby_warm": bool(standby and recorded.standby_warm), "message": recorded.message}


def status(spec: NodeSpec) -> dict:
    """pid (None when not running), the inputs changed since its start, what the readiness URL answers and
    its supervision (restarts, the last cause)."""
    pid = running_pid(spec)
    code, body = probe(spec.ready_url) if spec.ready_url else (None, "no readiness URL")
    sup = supervision(spec)
    return {"changed": False, "node": spec.name, "pid": pid, "url": spec.ready_url, "http_status": code,
            "health": body, "changed_inputs": stale_inputs(spec) if pid is not None else [],
            "restarts": sup["restarts"], "last_cause": sup["last_cause"], "supervisor": sup}


def wait_ready(spec: NodeSpec, timeout_s: float | None = None) -> dict:
    """Wait until the readiness URL answers 200; fail at once, with the log's tail, if the process exits and
    no supervisor is restarting it (a restart in its backoff is waited for, within the timeout)."""
    timeout_s = spec.ready_timeout_s if timeout_s is None else timeout_s
    deadline = time.monotonic() + timeout_s
    while True:
        pid = running_pid(spec)
        if pid is None and not _being_restarted(spec):
            recorded = read_state(spec.state_file)
            why = f" ({recorded.message})" if recorded is not None and recorded.message else ""
            return {"failed": True, "pid": None,
                    "msg": f"{spec.name} exited during start-up{why}; last lines of {spec.log}:\n{tail(spec.log)}"}
        if pid is not None and spec.ready_url is None and _supervisor_saw_ready(spec):
            return {"pid": pid, "msg": f"{spec.name} running"}
        code, body = probe(spec.ready_url) if pid is not None and spec.ready_url else (None, "restarting")
        if code == 200 and _supervisor_saw_ready(spec):
            return {"pid": pid, "health": body, "msg": f"{spec.name} ready"}
        if time.monotonic() > deadline:
            return {"failed": True, "pid": pid,
                    "msg": f"{spec.name}: {spec.ready_url} not ready after {timeout_s:g} s (last: {code} {body}); "
                           f"last lines of {spec.log}:\n{tail(spec.log)}"}
        time.sleep(POLL_S)


def _supervisor_saw_ready(spec: NodeSpec) -> bool:
    """Its supervisor, if it has one, has seen it ready too (so a death from now on is a crash it restarts)."""
    recorded = read_state(spec.state_file)
    return recorded is None or recorded.state == "running" or supervisor_pid(spec) is None


def _being_restarted(spec: NodeSpec) -> bool:
    """A live supervisor that has not given up: the node is (about to be) started again."""
    recorded = read_state(spec.state_file)
    return supervisor_pid(spec) is not None and (recorded is None or recorded.state not in FINAL)


def start(spec: NodeSpec, *, wait: bool = True, timeout_s: float | None = None) -> dict:
    """Start unless running, restart if an input changed since its start (or it runs unsupervised); then wait
    for readiness."""
    changed = stale_inputs(spec) if running_pid(spec) is not None else []
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
            "supervisor_pid": supervisor_pid(spec), "msg": msg}


DRAINABLE = ("stage", "prefill", "decode")  # the roles that drain on SIGUSR1 (mlxcel/loading_process.py)


def drain(spec: NodeSpec) -> dict:
    """SIGUSR1 to a serving stage, prefill or decode node: it takes no new work, what it holds finishes.

    Refused (nothing signalled) unless its readiness URL answers 200 naming one of those roles: any
    other process would die of SIGUSR1 (a coordinator or router drains when it stops, on SIGTERM)."""
    pid = running_pid(spec)
    if pid is None:
        return {"failed": True, "changed": False, "pid": None, "msg": f"{spec.name} not running"}
    code, body = probe(spec.ready_url) if spec.ready_url else (None, "no readiness URL")
    role = body.get("role") if isinstance(body, dict) else None
    if code != 200 or role not in DRAINABLE:
        return {"failed": True, "changed": False, "pid": pid,
                "msg": f"{spec.name} cannot be drained: only a serving {', '.join(DRAINABLE)} node can "
                       f"({spec.ready_url} answers {code} {body})"}
    if isinstance(body, dict) and body.get("draining"):
        return {"changed": False, "pid": pid, "health": body, "msg": f"{spec.name} already draining"}
    os.kill(pid, signal.SIGUSR1)
    return {"changed": True, "pid": pid, "msg": f"{spec.name} draining"}


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
