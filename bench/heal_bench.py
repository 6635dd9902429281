"""Heal benchmark: SIGKILL one node of a deployed pidfile cluster, time until the cluster serves again.

No operator action: the node's supervisor (``mlxcel node supervise``) restarts it, from its warm
standby when it has one, and the front end (coordinator or router) takes it back at its next probe.
Each run waits until the supervisor reports the node running (and, unless ``--cold``, its standby
warm), kills the node's process, then sends a chat request (4 tokens, no retries of its own) every
100 ms until one completes. A row records: kill -> the node's ``/health`` 200 (``node_ready_s``, as
seen between requests, and the supervisor's own ``last_heal_s``), kill -> a completed request
(``serving_s``) and every request (``attempts``: start after the kill, seconds, HTTP status).

    python -m bench.heal_bench --node .mlxcel/cluster/stage-1/node.toml --url http://127.0.0.2:8080 --runs 3

One JSON line per run on stdout; --out appends them with the environment (``bench: heal``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path

import httpx

from mlxcel.node import supervisor
from mlxcel.node.spec import load_node_spec

POLL_S = 0.1


def wait_for(predicate, timeout_s: float, what: str):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(POLL_S)
    raise SystemExit(f"heal_bench: {what} not within {timeout_s:g} s")


def served(client: httpx.Client, url: str, model: str, attempts: list | None = None, timeout_s: float = 30) -> bool:
    """One chat request; ``attempts`` gets (start, seconds, HTTP status or the error's name)."""
    body = {"model": model, "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": "Hi"}]}
    began = time.monotonic()
    try:
        status: int | str = client.post(f"{url}/v1/chat/completions", json=body, timeout=timeout_s).status_code
    except httpx.HTTPError as exc:
        status = type(exc).__name__
    if attempts is not None:
        attempts.append((began, time.monotonic() - began, status))
    return status == 200


def one_run(spec, url: str, model: str, cold: bool, settle_s: float,  # type: ignore[no-untyped-def]
            attempt_s: float, headers: dict[str, str]) -> dict:
    def settled() -> dict | None:
        status = supervisor.status(spec)
        sup = status["supervisor"]
        ok = status["http_status"] == 200 and sup["state"] == "running" and (cold or sup["standby_warm"])
        return status if ok else None

    before = wait_for(settled, 300, "the node running (with its standby warm)")
    time.sleep(settle_s)
    with httpx.Client(headers=headers) as client:
        wait_for(lambda: served(client, url, model), 120, "the cluster serving before the kill")
        killed = time.monotonic()
        os.kill(before["pid"], signal.SIGKILL)
        ready_at, attempts = None, []  # type: ignore[var-annotated]
        while not served(client, url, model, attempts, attempt_s):
            if ready_at is None and supervisor.status(spec)["http_status"] == 200:
                ready_at = time.monotonic()
            time.sleep(POLL_S)
        serving = time.monotonic() - killed
    after = supervisor.status(spec)
    return {"bench": "heal", "node": spec.name, "cold": cold, "serving_s": round(serving, 2),
            "node_ready_s": round((ready_at or time.monotonic()) - killed, 2),
            "last_heal_s": after["supervisor"]["last_heal_s"], "restarts": after["restarts"],
            "from_standby": after["pid"] == before["supervisor"]["standby_pid"],
            "attempts": [[round(t - killed, 2), round(d, 2), code] for t, d, code in attempts]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--node", required=True, help="the killed node's node TOML (mlxcel_home/node.toml)")
    p.add_argument("--url", required=True, help="the front end's base URL (coordinator or router)")
    p.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    p.add_argument("--api-key-file", default=None)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--cold", action="store_true",
                   help="do not wait for a warm standby (a cluster deployed with mlxcel_node_restart standby false)")
    p.add_argument("--settle", type=float, default=2.0, help="seconds to wait once settled, before the kill")
    p.add_argument("--attempt-timeout", type=float, default=30.0,
                   help="give up a request after this long and send the next (a request sent to the dead node "
                        "waits for the coordinator's exchange deadline; a new one shows when the cluster serves)")
    p.add_argument("--out", default=None, help="append the rows (with the environment) to this JSONL file")
    args = p.parse_args(argv)
    spec = load_node_spec(args.node)
    headers = {}
    if args.api_key_file:
        headers["Authorization"] = "Bearer " + Path(args.api_key_file).read_text().strip()
    model = args.model or httpx.get(f"{args.url}/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
    rows = []
    for _ in range(args.runs):
        row = one_run(spec, args.url, model, args.cold, args.settle, args.attempt_timeout, headers)
        print(json.dumps(row), flush=True)
        rows.append(row)
    print(f"kill -> serving: median {statistics.median(r['serving_s'] for r in rows):.1f} s "
          f"(min {min(r['serving_s'] for r in rows):.1f}, max {max(r['serving_s'] for r in rows):.1f})",
          file=sys.stderr)
    if args.out:
        from bench.environment import environment

        with open(args.out, "a", encoding="utf-8") as out:
            for row in rows:
                out.write(json.dumps({**row, "env": environment()}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
