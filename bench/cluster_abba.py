"""The deployed local cluster's processes against a single-node server, side by side (ABBA).

    python -m bench.cluster_abba --hosts 127.0.0.91,127.0.0.92,127.0.0.93,127.0.0.94 --concurrency 1,4 --rounds 4

Starts the processes ``scripts/serve.sh`` deploys on one box, with the same flags, on addresses of
your choosing (so it runs beside another deployment): a coordinator (``--pp-auto 2 --cluster-peers``,
``--threads 1``, plus ``--server-args``) and two stages (``--pp-peer``, ``--threads 1``), and a
single-node ``mlxcel-server`` (plus ``--server-args``; its BLAS threads by default). Then
``bench/serve_bench.py``'s side-by-side driver runs every level against both, same prompts, the order
flipping every level and round. Rows (``bench: serve``, servers ``single`` and ``cluster``) go to
``--out``/serve_bench.jsonl with ``load_1m``, the host's 1-minute load average after each level.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

from bench import serve_bench
from bench.disagg_bench import free_port
from bench.environment import write_jsonl


def server(args: list[str], host: str, port: int, log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "mlxcel", "serve", *args, "--host", host, "--port", str(port), "--log-level", "warning"]
    with log.open("wb") as fh:
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=fh, env={**os.environ, **(env or {})})


def start_cluster(args: argparse.Namespace, work: Path, name: str, hosts: list[str],
                  env: dict[str, str], stage_args: Sequence[str] = ()) -> tuple[str, list[subprocess.Popen]]:
    """A coordinator on ``hosts[0]`` and a stage on each further host, as the deployment starts them;
    ``env`` goes to every process of the cluster, ``stage_args`` to every stage. Returns its URL and the
    processes, coordinator last."""
    coord_h, *stage_h = hosts
    secret = work / f"{name}.secret"
    secret.write_text(os.urandom(32).hex() + "\n")
    secret.chmod(0o600)
    control = [f"{h}:{free_port(h)}" for h in stage_h]
    procs = [server(["-m", args.model, "--pp-peer", "--cluster-control-addr", c, "--cluster-config-out",
                     str(work / f"{name}-stage-{i}.toml"), "--cluster-secret-file", str(secret), "--threads", "1",
                     *stage_args],
                    h, free_port(h), work / f"{name}-stage-{i}.log", env)
             for i, (h, c) in enumerate(zip(stage_h, control))]
    port = free_port(coord_h)
    procs.append(server(["-m", args.model, "--pp-auto", str(len(stage_h)), "--cluster-peers", ",".join(control),
                         "--cluster-control-addr", f"{coord_h}:{free_port(coord_h)}", "--cluster-config-out",
                         str(work / f"{name}.toml"), "--cluster-secret-file", str(secret), "--threads", "1",
                         "--served-model-name", "bench", *args.server_args.split()], coord_h, port,
                        work / f"{name}-coordinator.log", env))
    return f"http://{coord_h}:{port}", procs


def start(args: argparse.Namespace, work: Path) -> tuple[dict[str, tuple[str, subprocess.Popen]], list[subprocess.Popen]]:
    """The single node and every cluster of --clusters: {label: (url, serving process)} and all processes."""
    single_h = args.hosts[0]
    port = free_port(single_h)
    single = server(["-m", args.model, "--served-model-name", "bench", *args.server_args.split()], single_h, port,
                    work / "single.log")
    servers = {"single": (f"http://{single_h}:{port}", single)}
    procs = [single]
    for k, (name, env) in enumerate(args.clusters):
        url, started = start_cluster(args, work, name, args.hosts[1 + 3 * k: 4 + 3 * k], env)
        procs += started
        servers[name] = (url, started[-1])
    return servers, procs


def wait_ready(servers: dict[str, tuple[str, subprocess.Popen]], timeout: float = 600) -> None:
    """Every server answers /health (a coordinator once its stages have joined)."""
    for url, proc in servers.values():
        serve_bench.wait_until_serving(url, proc, timeout)


def _clusters(text: str) -> list[tuple[str, dict[str, str]]]:
    """"cluster,one=MLXCEL_X=4" -> [("cluster", {}), ("one", {"MLXCEL_X": "4"})]."""
    out = []
    for item in text.split(","):
        name, _, env = item.partition("=")
        out.append((name, dict(kv.split("=", 1) for kv in env.split(";") if kv)))
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.cluster_abba", description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", default="models/smollm2-135m-instruct")
    p.add_argument("--hosts", type=lambda s: s.split(","),
                   default=["127.0.0.91", "127.0.0.92", "127.0.0.93", "127.0.0.94", "127.0.0.95", "127.0.0.96",
                            "127.0.0.97"],
                   help="the single node, then coordinator, stage, stage for each cluster")
    p.add_argument("--clusters", type=_clusters, default=[("cluster", {})],
                   help="comma-separated NAME[=ENV=VALUE;...]: clusters to start, the env given to each of their processes")
    p.add_argument("--server-args", default="--parallel 8 --max-batch-size 8")
    p.add_argument("--concurrency", default="1,4")
    p.add_argument("--requests", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--label", default="", help="recorded in every row (e.g. the lever under test)")
    p.add_argument("--out", type=Path, default=Path("bench/results") / time.strftime("%Y-%m-%d"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sb = serve_bench.parse_args(["--concurrency", args.concurrency, "--requests", str(args.requests),
                                 "--max-tokens", str(args.max_tokens), "--rounds", str(args.rounds), "--ignore-eos"])
    with tempfile.TemporaryDirectory(prefix="cluster-abba-") as tmp:
        servers, procs = start(args, Path(tmp))
        try:
            wait_ready(servers)
            for url, _ in servers.values():
                serve_bench.warm(url, "bench")
            rows = [{**row, "label": args.label, "model_dir": args.model}
                    for row in serve_bench.run_side_by_side({k: (u, "bench") for k, (u, _) in servers.items()}, sb)]
        finally:
            for proc in procs[::-1]:
                proc.terminate()
            for proc in procs:
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    write_jsonl(args.out / "serve_bench.jsonl", [{**r, "run": stamp} for r in rows])
    print(f"cluster_abba: {len(rows)} rows -> {args.out}/serve_bench.jsonl", file=sys.stderr)
    return 1 if any(r["errors"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
