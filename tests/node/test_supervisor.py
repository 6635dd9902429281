"""mlxcel node: real child processes (a tiny HTTP server on loopback) started, probed and stopped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Iterator

import pytest

from mlxcel.node import supervisor
from mlxcel.node.spec import NodeSpec, NodeSpecError, load_node_spec
from tests.ports import free_port

pytestmark = [pytest.mark.timeout(60), pytest.mark.proc]
REPO = Path(__file__).resolve().parents[2]

# argv: port, HTTP status to answer, 1 to ignore SIGTERM, a marker (the test's directory)
CHILD = """
import http.server, json, signal, sys
port, code, ignore_term = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
if ignore_term:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"status": "ready" if code == 200 else "loading"}).encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
print("child serving on", port, flush=True)
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def _pids_naming(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return [pid for pid in found if pid != os.getpid()]


@pytest.fixture
def home(tmp_path: Path) -> Iterator[Path]:
    """The node's directory; every process still naming it is killed afterwards, by pid.

    Children that ended become zombies of this process until ``subprocess`` reaps them at its next Popen.
    """
    yield tmp_path
    time.sleep(0.05)  # a child exec'd an instant ago may still show an empty command line
    for pid in _pids_naming(str(tmp_path)):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def write_spec(home: Path, *, code: int = 200, ignore_term: bool = False, script: str = CHILD,
               url: bool = True, **extra: object) -> Path:
    """A node TOML for the child; ``extra`` adds top-level keys or [ready] timeout_s (ready_timeout_s)."""
    port = free_port()
    command = [sys.executable, "-c", script, str(port), str(code), "1" if ignore_term else "0", str(home)]
    ready = {"timeout_s": extra.pop("ready_timeout_s", 10)} | ({"url": f"http://127.0.0.1:{port}/health"} if url else {})
    top = {"name": "test-node", "command": command, "stop_grace_s": 5, **extra}
    lines = [f"{key} = {json.dumps(value)}" for key, value in top.items()]
    lines += ["[ready]"] + [f"{key} = {json.dumps(value)}" for key, value in ready.items()]
    path = home / "node.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def alive(pid: int) -> bool:
    return supervisor._command_line(pid) is not None


def test_start_status_start_again_stop(home: Path) -> None:
    spec = load_node_spec(write_spec(home))
    started = supervisor.start(spec)
    assert started["changed"] and not started.get("failed"), started
    pid = started["pid"]
    assert int(spec.pidfile.read_text()) == pid and alive(pid)
    assert os.getpgid(pid) == pid  # its own session
    status = supervisor.status(spec)
    assert (status["pid"], status["http_status"], status["health"]) == (pid, 200, {"status": "ready"})
    again = supervisor.start(spec)
    assert (again["changed"], again["pid"], again["restarted"]) == (False, pid, False), again
    stopped = supervisor.stop(spec)
    assert stopped["changed"] and not stopped["killed"] and not alive(pid)
    assert not spec.pidfile.exists()
    assert supervisor.status(spec)["pid"] is None and supervisor.status(spec)["http_status"] is None
    assert supervisor.stop(spec)["changed"] is False
    assert "child serving on" in spec.log.read_text() and "mlxcel node start" in spec.log.read_text()


def test_stale_pidfile_is_ignored_and_never_signalled(home: Path) -> None:
    spec = load_node_spec(write_spec(home))
    dead = subprocess.Popen(["true"])
    dead.wait()
    spec.pidfile.write_text(f"{dead.pid}\n")
    assert supervisor.status(spec)["pid"] is None
    spec.pidfile.write_text(f"{os.getpid()}\n")  # alive, but another program (this test)
    assert supervisor.stop(spec) == {"changed": False, "pid": None, "msg": "test-node not running"}
    assert not spec.pidfile.exists()
    spec.pidfile.write_text(f"{os.getpid()}\n")
    started = supervisor.start(spec)
    assert started["changed"] and started["pid"] != os.getpid()
    assert int(spec.pidfile.read_text()) == started["pid"]
    supervisor.stop(spec)


def test_a_node_whose_pidfile_was_lost_is_found_by_its_command_line(home: Path) -> None:
    spec = load_node_spec(write_spec(home))
    pid = supervisor.start(spec)["pid"]
    spec.pidfile.unlink()
    assert supervisor.status(spec)["pid"] == pid
    assert supervisor.start(spec)["changed"] is False  # no second copy on the same port
    assert supervisor.stop(spec)["pid"] == pid and not alive(pid)


def test_match_is_on_word_boundaries(home: Path) -> None:
    spec = load_node_spec(write_spec(home))
    pid = supervisor.start(spec)["pid"]
    spec.pidfile.unlink()  # found by the scan of command lines
    port = spec.command[3]
    assert supervisor.running_pid(replace(spec, match=f"{port} 200")) == pid
    assert supervisor.running_pid(replace(spec, match=port[:-1])) is None  # port 1234 is not port 12345
    assert supervisor.running_pid(replace(spec, match=port[1:])) is None
    supervisor.stop(spec)


def test_a_changed_input_restarts_the_node(home: Path) -> None:
    secret = home / "cluster.secret"
    secret.write_text("one\n")
    spec = load_node_spec(write_spec(home, inputs=["cluster.secret"]))
    first = supervisor.start(spec)["pid"]
    assert supervisor.start(spec)["restarted"] is False
    secret.write_text("two\n")
    again = supervisor.start(spec)
    assert again["restarted"] and again["changed_inputs"] == [str(secret)], again
    assert again["pid"] != first and not alive(first) and alive(again["pid"])
    assert again["msg"] == f"test-node restarted ({secret} changed)"
    supervisor.stop(spec)


def test_a_child_that_exits_at_once_fails_with_the_log_tail(home: Path) -> None:
    script = "import sys; print('bad flag --frobnicate', flush=True); sys.exit(3)"
    spec = load_node_spec(write_spec(home, script=script))
    started = time.monotonic()
    result = supervisor.start(spec)
    assert result["failed"] and result["pid"] is None
    assert "test-node exited during start-up" in result["msg"] and "bad flag --frobnicate" in result["msg"]
    assert time.monotonic() - started < 5  # at once, not after the readiness timeout


def test_readiness_timeout_names_the_url_and_the_last_answer(home: Path) -> None:
    spec = load_node_spec(write_spec(home, code=503, ready_timeout_s=0.6))
    started = time.monotonic()
    result = supervisor.start(spec)
    assert result["failed"] and alive(result["pid"])
    assert f"{spec.ready_url} not ready after 0.6 s (last: 503 {{'status': 'loading'}})" in result["msg"], result
    assert 0.6 <= time.monotonic() - started < 5
    assert supervisor.stop(spec)["changed"]


def test_stop_kills_a_process_that_ignores_sigterm_after_the_grace(home: Path) -> None:
    spec = load_node_spec(write_spec(home, ignore_term=True, stop_grace_s=0.4))
    pid = supervisor.start(spec)["pid"]
    began = time.monotonic()
    result = supervisor.stop(spec)
    assert result["killed"] and result["msg"] == "test-node killed (SIGKILL after 0.4 s)"
    assert 0.4 <= time.monotonic() - began < 3 and not alive(pid)


def test_without_a_readiness_url_running_is_ready(home: Path) -> None:
    spec = load_node_spec(write_spec(home, url=False))
    result = supervisor.start(spec)
    assert result["msg"] == "test-node started" and alive(result["pid"])
    supervisor.stop(spec)


def test_cli_prints_json_and_exits_1_on_a_failed_start(home: Path) -> None:
    ok = write_spec(home)
    cli = [sys.executable, "-m", "mlxcel", "node"]
    status = subprocess.run([*cli, "status", "--config", str(ok)], capture_output=True, text=True, cwd=REPO)
    assert status.returncode == 0 and json.loads(status.stdout)["pid"] is None
    bad = write_spec(home, script="raise SystemExit('no model here')")
    start = subprocess.run([*cli, "start", "--config", str(bad)], capture_output=True, text=True, cwd=REPO)
    assert start.returncode == 1 and "no model here" in json.loads(start.stdout)["msg"]
    (home / "broken.toml").write_text('command = ["x"]\nbogus = 1\n')
    broken = subprocess.run([*cli, "stop", "--config", str(home / "broken.toml")], capture_output=True, text=True,
                            cwd=REPO)
    assert broken.returncode == 1 and "unknown key(s) bogus" in broken.stderr and broken.stdout == ""


def test_cli_wait_waits_for_a_started_node_and_fails_for_one_not_running(home: Path) -> None:
    spec_path = write_spec(home)
    cli = [sys.executable, "-m", "mlxcel", "node"]
    gone = subprocess.run([*cli, "wait", "--config", str(spec_path)], capture_output=True, text=True, cwd=REPO)
    assert gone.returncode == 1 and "exited during start-up" in json.loads(gone.stdout)["msg"]
    started = subprocess.run([*cli, "start", "--no-wait", "--config", str(spec_path)], capture_output=True, text=True,
                             cwd=REPO)
    try:
        pid = json.loads(started.stdout)["pid"]
        ready = subprocess.run([*cli, "wait", "--config", str(spec_path)], capture_output=True, text=True, cwd=REPO)
        assert ready.returncode == 0 and json.loads(ready.stdout)["pid"] == pid
    finally:
        supervisor.stop(load_node_spec(spec_path))


def test_spec_defaults_and_relative_paths(tmp_path: Path) -> None:
    (tmp_path / "n.toml").write_text('command = ["/bin/sleep", "30"]\ninputs = ["a.toml"]\n')
    spec = load_node_spec(tmp_path / "n.toml")
    assert spec == NodeSpec(name="n", command=("/bin/sleep", "30"), directory=tmp_path, match="/bin/sleep 30",
                            pidfile=tmp_path / "n.pid", log=tmp_path / "n.log", inputs=(tmp_path / "a.toml",))


@pytest.mark.parametrize("body, message", [
    ("name = 'x'\n", "command is missing"),
    ("command = []\n", "command is empty"),
    ("command = ['a']\n[environment]\nMLXCEL_CLUSTER_SECRET = 'abc'\n", "pass its path instead (MLXCEL_CLUSTER_SECRET_FILE)"),
    ("command = ['a']\n[environment]\nMLXCEL_API_KEY = 'abc'\n", "pass its path instead (MLXCEL_API_KEY_FILE)"),
    ("command = ['a']\nstop_grace_s = 0\n", "stop_grace_s must be a positive number of seconds"),
    ("command = ['a']\n[ready]\nurl = 'localhost:80'\n", "url must be an http:// or https:// URL"),
    ("command = ['a']\n[ready]\ntimeout = 3\n", "unknown key(s) timeout in [ready]"),
    ("command = ['a'\n", "not valid TOML"),
    ("command = ['a']\n[restart]\npolicy = 'always'\n", "[restart] policy must be one of on-failure, never"),
    ("command = ['a']\n[restart]\nlimit = 0\n", "[restart] limit must be a positive integer"),
    ("command = ['a']\n[restart]\nbackoff_s = -1\n", "[restart] backoff_s must be a positive number of seconds"),
    ("command = ['a']\n[restart]\nstandby = 'yes'\n", "[restart] standby must be true or false"),
    ("command = ['a']\n[restart]\nretries = 3\n", "unknown key(s) retries in [restart]"),
])
def test_spec_errors_name_the_key(tmp_path: Path, body: str, message: str) -> None:
    (tmp_path / "n.toml").write_text(body)
    with pytest.raises(NodeSpecError, match="n.toml: ") as err:
        load_node_spec(tmp_path / "n.toml")
    assert message in str(err.value)


# -- supervision: restarts, their causes, the crash-loop limit, stopping it all -----------------------------------

# CHILD, but a run that finds <home>/crash exits 1 at once (before it is ready): a crash loop on demand
CRASHY = "import os, sys\nif os.path.exists(os.path.join(sys.argv[4], 'crash')):\n    sys.exit(1)\n" + CHILD
FAST = {"restart": {"backoff_s": 0.05, "backoff_max_s": 0.2, "limit": 3, "reset_s": 30}}


def write_supervised_spec(home: Path, script: str = CHILD, restart: dict | None = None) -> Path:
    path = write_spec(home, script=script)
    table = (restart or FAST)["restart"]
    path.write_text(path.read_text() + "[restart]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in table.items()))
    return path


def wait_for(predicate, timeout_s: float = 10.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout_s} s")


def test_a_killed_node_is_restarted_by_its_supervisor_and_serves_again(home: Path) -> None:
    spec = load_node_spec(write_supervised_spec(home))
    first = supervisor.start(spec)
    sup = first["supervisor_pid"]
    assert first["changed"] and alive(sup) and os.getpgid(sup) == sup != os.getpgid(first["pid"])
    killed_at = time.monotonic()
    os.kill(first["pid"], signal.SIGKILL)
    status = wait_for(lambda: (s := supervisor.status(spec))["http_status"] == 200 and s["pid"] != first["pid"] and s)
    healed = time.monotonic() - killed_at
    assert status["pid"] == int(spec.pidfile.read_text()) and alive(status["pid"])
    assert (status["restarts"], status["last_cause"]) == (1, "signal SIGKILL"), status
    assert status["supervisor"]["pid"] == sup and status["changed_inputs"] == []
    assert wait_for(lambda: supervisor.status(spec)["supervisor"]["state"] == "running")
    assert healed < 20, healed  # a python child and 0.05 s of backoff; slow only on a loaded box
    log = spec.log.read_text()
    assert "mlxcel node supervise: test-node ended (signal SIGKILL) after" in log and "restart 1 in 0.05 s" in log
    assert "test-node ready again" in log and "(signal SIGKILL; restart 1)" in log
    assert supervisor.start(spec)["changed"] is False  # healed: nothing to do
    stopped = supervisor.stop(spec)
    assert stopped["changed"] and stopped["supervisor_pid"] == sup and not alive(sup) and not alive(status["pid"])
    assert _pids_naming(str(home)) == [] and not spec.pidfile.exists()
    assert supervisor.status(spec)["supervisor"]["state"] == "stopped"


def test_a_crash_loop_stops_at_the_limit_with_a_clear_status(home: Path) -> None:
    spec = load_node_spec(write_supervised_spec(home, script=CRASHY))
    first = supervisor.start(spec)
    assert first["changed"] and not first.get("failed"), first
    (home / "crash").touch()  # from now on every run exits 1 at once
    os.kill(first["pid"], signal.SIGKILL)
    sup = wait_for(lambda: (s := supervisor.status(spec)["supervisor"])["state"] == "crash-loop" and s["pid"] is None
                   and s)  # the supervisor gave up and exited
    assert (sup["restarts"], sup["last_cause"]) == (3, "exit 1"), sup
    assert "crash loop, 3 restarts in a row, none of which ran 30 s" in sup["message"] and "giving up" in sup["message"]
    assert supervisor.status(spec)["pid"] is None and _pids_naming(str(home)) == []
    log = spec.log.read_text()
    assert [line.count("ended (exit 1)") for line in log.splitlines() if "ended (" in line].count(1) == 3, log
    waited = supervisor.wait_ready(spec, 5)
    assert waited["failed"] and "crash loop" in waited["msg"]
    (home / "crash").unlink()
    again = supervisor.start(spec)  # the operator's start begins afresh
    assert again["changed"] and not again.get("failed"), again
    assert supervisor.status(spec)["restarts"] == 0
    supervisor.stop(spec)


def test_a_clean_exit_and_a_usage_error_are_not_restarted(home: Path) -> None:
    for code, state in ((0, "exited"), (2, "failed")):
        script = f"import os, sys, time\nif os.path.exists(os.path.join(sys.argv[4], 'quit')):\n    sys.exit({code})\n" \
                 "open(os.path.join(sys.argv[4], 'quit'), 'w').close()\n" + CHILD
        spec = load_node_spec(write_supervised_spec(home, script=script))
        (home / "quit").unlink(missing_ok=True)
        first = supervisor.start(spec)
        os.kill(first["pid"], signal.SIGKILL)  # the restart then ends with the code
        sup = wait_for(lambda: (s := supervisor.status(spec)["supervisor"])["state"] in ("exited", "failed")
                       and s["pid"] is None and s)
        assert (sup["state"], sup["restarts"], sup["last_cause"]) == (state, 1, f"exit {code}"), sup
        assert "not restarted" in sup["message"]


def test_sigterm_to_the_supervisor_stops_the_node_too(home: Path) -> None:
    spec = load_node_spec(write_supervised_spec(home))
    first = supervisor.start(spec)
    os.kill(first["supervisor_pid"], signal.SIGTERM)
    wait_for(lambda: not alive(first["supervisor_pid"]) and not alive(first["pid"]))
    assert supervisor.status(spec)["supervisor"]["state"] == "stopped" and not spec.pidfile.exists()


def test_a_node_running_without_its_supervisor_is_restarted_under_one(home: Path) -> None:
    spec = load_node_spec(write_supervised_spec(home))
    first = supervisor.start(spec)
    os.kill(first["supervisor_pid"], signal.SIGKILL)  # the node runs on, unsupervised
    wait_for(lambda: not alive(first["supervisor_pid"]))
    assert supervisor.status(spec)["changed_inputs"] == ["supervision"]
    again = supervisor.start(spec)
    assert again["restarted"] and again["msg"] == "test-node restarted (supervision changed)", again
    assert again["pid"] != first["pid"] and not alive(first["pid"])
    assert supervisor.supervisor_pid(spec) is not None
    supervisor.stop(spec)


def test_a_restart_hands_over_to_the_warm_standby(home: Path) -> None:
    """An mlxcel-server node gets a standby (its command line, imports done, waiting on a pipe) once it is ready;
    a restart makes that process the node, and a new standby follows."""
    program = home / "mlxcel-server"  # the real standby protocol, with one module to warm
    program.write_text(f"#!{sys.executable}\nimport mlxcel.commands.standby as standby\n"
                       "standby.WARM_MODULES = ('json',)\nstandby.wait_if_standby()\n" + CHILD)
    program.chmod(0o755)
    path = write_supervised_spec(home)
    text = path.read_text().replace(json.dumps(sys.executable) + ', "-c", ' + json.dumps(CHILD), json.dumps(str(program)))
    assert text != path.read_text()
    path.write_text(text)
    spec = load_node_spec(path)
    first = supervisor.start(spec)
    sup = wait_for(lambda: (s := supervisor.status(spec)["supervisor"])["standby_warm"] and s)
    standby = sup["standby_pid"]
    assert alive(standby) and supervisor.running_pid(spec) == first["pid"]  # the standby is not the node
    spec.pidfile.unlink()
    assert supervisor.running_pid(spec) == first["pid"]  # nor found as the node by its command line
    os.kill(first["pid"], signal.SIGKILL)
    status = wait_for(lambda: (s := supervisor.status(spec))["http_status"] == 200 and s["pid"] == standby and s)
    assert status["restarts"] == 1 and "from its warm standby" in spec.log.read_text()
    after = wait_for(lambda: (s := supervisor.status(spec)["supervisor"])["standby_warm"] and s)
    assert after["standby_pid"] not in (None, standby)
    supervisor.stop(spec)
    assert not alive(after["standby_pid"]) and _pids_naming(str(home)) == []


def test_stop_during_a_restart_backoff_leaves_no_process(home: Path) -> None:
    slow = {"restart": {"backoff_s": 30, "limit": 3, "standby": False}}
    spec = load_node_spec(write_supervised_spec(home, restart=slow))
    first = supervisor.start(spec)
    os.kill(first["pid"], signal.SIGKILL)
    wait_for(lambda: supervisor.status(spec)["supervisor"]["state"] == "restarting")
    assert supervisor.launch(spec)["msg"] == "test-node is being restarted by its supervisor"  # no second copy
    began = time.monotonic()
    stopped = supervisor.stop(spec)
    assert stopped["changed"] and time.monotonic() - began < 5, stopped
    assert supervisor.status(spec)["supervisor"]["state"] == "stopped" and _pids_naming(str(home)) == []
