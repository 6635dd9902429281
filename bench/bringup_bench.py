"""Bring-up benchmark: time from launching a coordinator and two stage processes to the first token.

Three ways to start the same 2-stage pipeline of --model on 127.0.0.2-.4, all three processes
launched at the same instant (t0):

- ``static``: ``--pp-auto 2 --cluster-peers ...`` and two ``--pp-peer --cluster-control-addr ...``;
- ``mdns``: ``--pp-auto 2 --cluster-discovery=mdns`` and two ``--pp-peer --cluster-discovery=mdns
  --cluster-discovery-target 127.0.0.1`` (beacons stay on this machine);
- ``toml``: a hand-written cluster TOML, ``--distributed-config F --node-id ...`` for all three.

Each run then waits for the coordinator's HTTP port, polls ``/health`` every 20 ms until 200 and
sends one streamed chat request; the row records t0 -> ready and t0 -> first content token.
--runs rounds, the mode order reversed every other round (ABBA). One JSON line per run on stdout;
--out appends the rows with the environment (``bench: bringup``, a schema of ``mlxcel report``).

    python -m bench.bringup_bench --runs 4
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

HTTP = re.compile(r"serving \S+ on (http://[\d.]+:\d+)")
MODES = ("static", "mdns", "toml")


def free_port(host: str, kind: int = socket.SOCK_STREAM) -> int:
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Proc:
    def __init__(self, cwd: Path, argv: list[str]) -> None:
        cwd.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen([sys.executable, "-m", "mlxcel", "serve", *argv], cwd=cwd, text=True,
                                     stderr=subprocess.PIPE, stdout=subprocess.DEVNULL)
        self.lines: list[str] = []
        self.url: str | None = None
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)
            m = HTTP.search(line)
            if m and self.url is None:
                self.url = m.group(1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(2)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def commands(mode: str, tmp: Path, model: str, secret: Path) -> dict[str, list[str]]:
    common = ["-m", model, "--cluster-secret-file", str(secret), "--port", "0", "--log-level", "warning"]
    control = f"127.0.0.2:{free_port('127.0.0.2')}"
    stages = [f"127.0.0.{3 + i}:{free_port(f'127.0.0.{3 + i}')}" for i in range(2)]
    if mode == "toml":
        toml = tmp / "cluster.toml"
        body = f'[cluster]\nname = "bench"\n\n[[nodes]]\nid = "coordinator"\nrole = "coordinator"\naddress = "{control}"\n'
        for i, addr in enumerate(stages):
            body += f'\n[[nodes]]\nid = "stage-{i}"\nrole = "stage"\naddress = "{addr}"\n'
        toml.write_text(body)
        out = {f"stage-{i}": [*common, "--host", addr.split(":")[0], "--distributed-config", str(toml),
                              "--node-id", f"stage-{i}"] for i, addr in enumerate(stages)}
        out["coordinator"] = [*common, "--host", "127.0.0.2", "--distributed-config", str(toml), "--node-id", "coordinator"]
        return out
    if mode == "static":
        out = {f"stage-{i}": [*common, "--pp-peer", "--host", addr.split(":")[0], "--cluster-control-addr", addr]
               for i, addr in enumerate(stages)}
        out["coordinator"] = [*common, "--pp-auto", "2", "--host", "127.0.0.2", "--cluster-control-addr", control,
                              "--cluster-peers", ",".join(stages)]
        return out
    udp = str(free_port("0.0.0.0", socket.SOCK_DGRAM))
    mdns = ["--cluster-discovery", "mdns", "--cluster-discovery-port", udp]
    out = {f"stage-{i}": [*common, "--pp-peer", "--host", addr.split(":")[0], "--cluster-control-addr", addr, *mdns,
                          "--cluster-discovery-target", "127.0.0.1"] for i, addr in enumerate(stages)}
    out["coordinator"] = [*common, "--pp-auto", "2", "--host", "127.0.0.2", "--cluster-control-addr", control, *mdns]
    return out


def first_token(url: str) -> float:
    """Seconds until the first content token of a streamed chat request."""
    body = {"model": "bench", "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 8, "temperature": 0, "stream": True}
    start = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and '"content":"' in line.replace(" ", ""):
                return time.perf_counter() - start
    raise RuntimeError("the stream ended without a token")


def run_once(mode: str, model: str, secret: Path, timeout: float) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"bringup-{mode}-") as tmp:
        cmds = commands(mode, Path(tmp), model, secret)
        t0 = time.perf_counter()
        procs = {name: Proc(Path(tmp) / name, argv + ["--served-model-name", "bench"]) for name, argv in cmds.items()}
        coord = procs["coordinator"]
        try:
            while coord.url is None or _health(coord.url) != 200:
                if time.perf_counter() - t0 > timeout or coord.proc.poll() is not None:
                    raise RuntimeError(f"{mode}: coordinator not ready:\n" + "".join(coord.lines))
                time.sleep(0.02)
            ready = time.perf_counter() - t0
            token = first_token(coord.url)
            return {"bench": "bringup", "mode": mode, "ready_s": round(ready, 3),
                    "first_token_s": round(ready + token, 3), "model": Path(model).name}
        finally:
            for p in procs.values():
                p.stop()


def _health(url: str) -> int:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code
    except httpx.TransportError:
        return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/smollm2-135m-instruct")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--timeout", type=float, default=180)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        secret = Path(tmp) / "cluster.secret"
        secret.write_text(os.urandom(32).hex() + "\n")
        secret.chmod(0o600)
        for r in range(args.runs):
            for mode in (modes if r % 2 == 0 else modes[::-1]):
                row = {**run_once(mode, str(Path(args.model).resolve()), secret, args.timeout), "round": r}
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.out:
        from bench.environment import write_jsonl

        write_jsonl(args.out, rows)
    for mode in modes:
        times = [row["first_token_s"] for row in rows if row["mode"] == mode]
        print(f"{mode}: first token after {statistics.median(times):.2f} s median ({min(times):.2f}-{max(times):.2f}, "
              f"{len(times)} runs)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
