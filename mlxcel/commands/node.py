"""``mlxcel node start|stop|restart|status|wait|drain|show|supervise --config FILE``: one node (a node TOML).

Every command but ``supervise`` prints one JSON object on stdout (the Ansible role parses it): ``changed``
says whether a process was started or stopped, ``failed`` marks a failure. Exit status: 0 done (``status``
always, running or not); 1 the node failed to start or get ready (the message ends with the log's last
lines), or the TOML is invalid (one line on stderr); 2 usage. ``supervise`` is the supervising process
that ``start`` runs in the background (``mlxcel/node/supervise.py``): it logs to its stdout and exits 0
when stopped or when the node ended cleanly, 1 when it gave up.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from mlxcel.config import seconds
from mlxcel.errors import CLIError
from mlxcel.node import supervisor
from mlxcel.node.spec import NodeSpec, NodeSpecError, load_node_spec

EXIT_FAILED = 1


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """The ``node`` subcommand and its actions."""
    n = subparsers.add_parser("node", help="start, stop or report one node process (pidfile, log, readiness) from a node TOML")
    actions = n.add_subparsers(dest="node_command", required=True, metavar="ACTION")
    helps = {
        "start": "start unless running (restart if an input changed since), then wait until ready",
        "stop": "SIGTERM, then SIGKILL after the grace period; nothing to do when it is gone",
        "restart": "stop if running, start, wait until ready",
        "status": "pid and what the readiness URL answers (exit 0 running or not)",
        "wait": "wait until the running node is ready (exit 1 if it exits or the timeout passes); starts nothing",
        "drain": "a stage, prefill or decode node takes no new work (SIGUSR1); what it holds finishes",
        "show": "the resolved node TOML and its inputs fingerprint",
        "supervise": "run the node as a child and restart it when it dies (what start runs in the background)",
    }
    for action, text in helps.items():
        p = actions.add_parser(action, help=text)
        p.add_argument("--config", required=True, metavar="FILE", help="the node TOML (see mlxcel/node/spec.py)")
        if action in ("start", "restart", "wait"):
            p.add_argument("--timeout", type=seconds, default=None, metavar="S",
                           help="seconds to wait for readiness (default: [ready] timeout_s of the TOML)")
        if action in ("start", "restart"):
            p.add_argument("--no-wait", dest="wait", action="store_false", help="do not wait for readiness")
        p.set_defaults(func=run)


def describe(spec: NodeSpec) -> dict:
    """The spec as JSON, with every default filled in, and its fingerprint."""
    return {"name": spec.name, "command": list(spec.command), "directory": str(spec.directory),
            "match": spec.match, "pidfile": str(spec.pidfile), "log": str(spec.log),
            "inputs": [str(p) for p in spec.inputs], "environment": spec.environment,
            "ready": {"url": spec.ready_url, "timeout_s": spec.ready_timeout_s}, "stop_grace_s": spec.stop_grace_s,
            "restart": asdict(spec.restart), "fingerprint": supervisor.fingerprint(spec)}


def run(args: argparse.Namespace) -> int:
    try:
        spec = load_node_spec(Path(args.config))
    except NodeSpecError as exc:
        raise CLIError(str(exc)) from None
    action = args.node_command
    if action == "supervise":
        from mlxcel.node.supervise import supervise

        return supervise(spec)
    if action == "start":
        result = supervisor.start(spec, wait=args.wait, timeout_s=args.timeout)
    elif action == "restart":
        result = supervisor.restart(spec, wait=args.wait, timeout_s=args.timeout)
    elif action == "stop":
        result = supervisor.stop(spec)
    elif action == "status":
        result = supervisor.status(spec)
    elif action == "wait":
        result = supervisor.wait_ready(spec, args.timeout)
    elif action == "drain":
        result = supervisor.drain(spec)
    else:
        result = describe(spec)
    print(json.dumps(result), flush=True)
    return EXIT_FAILED if result.get("failed") else 0
