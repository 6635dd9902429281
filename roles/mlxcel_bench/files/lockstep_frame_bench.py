"""Two-host frame benchmark in lockstep, driven from the controller with Fabric.

The echo peer (``python -m bench.frame_bench --serve-echo ADDR:PORT``) starts on one host and runs
until its stdin closes; once it prints its listeners, the client (``--remote ADDR:PORT``) runs on
the other host and writes the JSONL rows there. Then the controller closes the echo's stdin.

Hosts are JSON objects from the Ansible inventory (connection, address, user, port, key, python,
workdir, secret): ``ssh`` hosts go through ``fabric.Connection``, ``local`` ones through
``invoke.Context`` (the same runner API, Fabric's base class).

    python lockstep_frame_bench.py --echo '{...}' --client '{...}' --port 19100 --out /path/frame.jsonl -- --quick
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import threading
import time
from typing import Any

import invoke
from fabric import Connection


class StdinGate:
    """A stdin for the echo peer that stays open until ``close()``, then reads as EOF."""

    def __init__(self) -> None:
        self._closed = threading.Event()

    def read(self, _size: int = -1) -> str:
        self._closed.wait()
        return ""

    def close(self) -> None:
        self._closed.set()


def connect(host: dict[str, Any]) -> invoke.Context:
    """Fabric for SSH hosts, invoke's local runner for ansible_connection=local."""
    if host.get("connection", "ssh") == "local":
        return invoke.Context()
    kwargs = {"key_filename": host["key"]} if host.get("key") else {}
    return Connection(host["ssh_host"], user=host.get("user") or None, port=int(host.get("ssh_port") or 22),
                      connect_timeout=15, connect_kwargs=kwargs)


def command(host: dict[str, Any], args: list[str]) -> str:
    python = shlex.quote(host["python"])
    return f"cd {shlex.quote(host['workdir'])} && exec {python} -m bench.frame_bench " + " ".join(map(shlex.quote, args))


def wait_for_listeners(promise: Any, timeout_s: float) -> str:
    """The echo peer's first stdout line (its listeners as JSON), or a one-line error."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out = "".join(promise.runner.stdout)
        if "\n" in out:
            return out.split("\n", 1)[0]
        if promise.runner.process_is_finished:
            raise SystemExit(f"echo peer exited: {''.join(promise.runner.stderr).strip()[-500:]}")
        time.sleep(0.1)
    raise SystemExit(f"echo peer printed no listeners within {timeout_s:.0f} s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--echo", type=json.loads, required=True, help="echo host (JSON)")
    p.add_argument("--client", type=json.loads, required=True, help="client host (JSON)")
    p.add_argument("--port", type=int, required=True, help="echo base port (suite i at port + i)")
    p.add_argument("--out", required=True, help="JSONL rows, on the client host")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("frame_args", nargs="*", help="more frame_bench options, after --")
    args = p.parse_args(argv)
    echo, client = args.echo, args.client
    gate = StdinGate()
    echo_cmd = command(echo, ["--serve-echo", f"{echo['address']}:{args.port}", "--cluster-secret-file", echo["secret"]])
    promise = connect(echo).run(echo_cmd, asynchronous=True, in_stream=gate, hide=True, warn=True, pty=False)
    try:
        listeners = wait_for_listeners(promise, 60)
        client_cmd = command(client, ["--remote", f"{echo['address']}:{args.port}", "--advertise", client["address"],
                                      "--cluster-secret-file", client["secret"], "--out", args.out, *args.frame_args])
        result = connect(client).run(client_cmd, hide=True, warn=True, pty=False, timeout=args.timeout)
    finally:
        gate.close()
    echo_result = promise.join()
    print(json.dumps({"echo": echo["name"], "client": client["name"], "listeners": json.loads(listeners),
                      "rc": result.exited, "echo_rc": echo_result.exited, "out": args.out,
                      "stdout_tail": result.stdout.strip().splitlines()[-12:], "stderr_tail": result.stderr[-1000:]}))
    return 0 if result.exited == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
