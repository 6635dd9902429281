"""How cost grows with the cluster: pipeline depth, bring-up fan-out, router width (issue 44 item 5).

    python -m bench.scaling_bench pipeline --stages 1,2,3,4,6,8 --rounds 2 --tokens 32
    python -m bench.scaling_bench bringup --peers 2,4,8,16,32 --rounds 2
    python -m bench.scaling_bench router --topologies 1x1,2x2,4x4,1x4,4x1 --requests 20
    python -m bench.scaling_bench fit bench/results/<date>/scaling_bench.jsonl   # fits + 16/64-host prediction

Every process is a real ``mlxcel serve`` on its own 127.0.0.x address, started by the launchers of the
other benchmarks: ``pipeline`` uses bench/pipeline_bench.py's ``StageCluster`` (stages on 127.0.0.3..)
and ``launch_server`` (the coordinator on 127.0.0.2, the single node, S=1, on 127.0.0.1); ``bringup``
uses bench/bringup_bench.py's ``Proc`` (peers on 127.0.0.20.., the ``--pp-auto`` coordinator on
127.0.0.2); ``router`` uses bench/disagg_bench.py's ``start_topology`` (router 127.0.0.70, prefill
.71-.74, decode .75-.78). Without ``-m`` a random llama of 32 layers (hidden 64) is made once in
``models/`` (git-ignored), so that every depth up to 32 has a layer per stage.

Rows (``bench: scaling_pipeline | scaling_bringup | scaling_router``, with the environment and the
host's load) go to ``--out``/scaling_bench.jsonl; ``fit`` reads them back and writes
``scaling_fit.json`` (per-unit costs with their standard errors and the prediction for 16 and 64
hosts on 10 GbE, bench/scaling_fit.py). The sweep order flips every round (ascending, descending).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import httpx

from bench import serve_bench
from bench.environment import load_1m, write_jsonl
from bench.pipeline_bench import COORDINATOR_HOST, REPO, StageCluster, launch_server, proc_cpu_s
from bench.stats import percentile

PEER_BASE = 20  # bring-up peers on 127.0.0.20, .21, ...
SINGLE_HOST = "127.0.0.1"


def rss_bytes(pid: int) -> int | None:
    """Resident set size of a process from /proc (None off Linux or once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def tiny_model(out: Path, layers: int = 32, hidden: int = 64) -> Path:
    """A random llama checkpoint under ``out`` (made once; ``mlxcel models make-random``)."""
    path = out / f"scaling-llama-{layers}x{hidden}"
    if not (path / "config.json").exists():
        from mlxcel.models.random_checkpoint import make_random_checkpoint

        make_random_checkpoint(path, family="llama", layers=layers, hidden=hidden)
    return path


def sweep(values: list[int], rnd: int) -> list[int]:
    """Ascending in even rounds, descending in odd ones (drift shows up as a round-to-round gap, not a slope)."""
    return list(values) if rnd % 2 == 0 else list(values)[::-1]


# -- pipeline -------------------------------------------------------------------------------------


ITL = "mlxcel_inter_token_latency_seconds"


def itl_totals(url: str) -> tuple[float, float]:
    """The server's inter-token latency histogram: (sum of seconds, count), from /metrics (docs/server.md).

    Measured where tokens leave the engine, so a tokenizer that holds bytes back (a random checkpoint's
    byte-level one streams whole words late) does not bunch the gaps a client would see."""
    total = count = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(f"{ITL}_sum "):
            total = float(line.split()[1])
        elif line.startswith(f"{ITL}_count "):
            count = float(line.split()[1])
    return total, count


def _level(url: str, streams: int, tokens: int, tag: str) -> tuple[list[serve_bench.RequestResult], float]:
    return asyncio.run(serve_bench.run_level(url, "bench", streams, 1, tokens, ignore_eos=True, tag=tag))


def pipeline_level(url: str, pids: list[int], stages: int, streams: int, tokens: int, rnd: int) -> dict[str, Any]:
    """One level: ``streams`` concurrent requests of ``tokens`` tokens; ms/token from the server's histogram,
    CPU-seconds of the serving process (first PID) and of the stages over the level."""
    itl0, cpu0 = itl_totals(url), [proc_cpu_s(p) for p in pids]
    results, wall = _level(url, streams, tokens, f"s{stages}-r{rnd}-b{streams}")
    cpu1, itl1 = [proc_cpu_s(p) for p in pids], itl_totals(url)
    gaps = itl1[1] - itl0[1]
    ok = [r for r in results if r.ok]
    n = sum(r.tokens for r in ok)
    cpu = [None if a is None or b is None else b - a for a, b in zip(cpu0, cpu1)]
    stage_cpu = [c for c in cpu[1:] if c is not None]
    return {"bench": "scaling_pipeline", "stages": stages, "streams": streams, "round": rnd, "tokens": n,
            "errors": len(results) - len(ok), "wall_s": round(wall, 4), "tok_s": n / wall if wall > 0 else None,
            "ms_per_token": (itl1[0] - itl0[0]) * 1e3 / gaps if gaps else None,
            "ttft_ms": percentile([r.ttft * 1e3 for r in ok], 50), "cpu_s_coordinator": cpu[0],
            "cpu_s_stages": sum(stage_cpu) if len(pids) > 1 else None,
            "rss_bytes": sum(x for x in map(rss_bytes, pids) if x), "processes": len(pids), "load_1m": load_1m()}


def pipeline_point(model: Path, stages: int, work: Path, args: argparse.Namespace, rnd: int) -> list[dict[str, Any]]:
    """Start S stages and a coordinator (or the single node for S=1), measure 1 and --streams streams."""
    cluster, proc = None, None
    try:
        if stages == 1:
            proc, url = launch_server(["-m", str(model), "--parallel", "8", "--prefix-cache-mb", "0"], SINGLE_HOST)
        else:
            (work / f"s{stages}-r{rnd}").mkdir(parents=True)
            cluster = StageCluster(model, stages, work / f"s{stages}-r{rnd}")
            cluster.start()
            proc, url = launch_server(["-m", str(model), "--parallel", "8", "--distributed-config",
                                       str(cluster.toml), "--node-id", "coordinator"], COORDINATOR_HOST)
        pids = [proc.pid, *(cluster.pids if cluster else [])]
        _level(url, 1, 4, f"warm{stages}")
        _level(url, args.streams, 4, f"warmb{stages}")
        rows = []
        for streams in (1, args.streams):
            rows.append({**pipeline_level(url, pids, stages, streams, args.tokens, rnd), "model": model.name})
            print(f"pipeline S={stages} streams={streams}: {rows[-1]['ms_per_token'] or 0:.2f} ms/token, "
                  f"{rows[-1]['tok_s'] or 0:.1f} tok/s", file=sys.stderr, flush=True)
        return rows
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if cluster is not None:
            cluster.stop()


# -- bring-up -------------------------------------------------------------------------------------

PUSH_LINE = re.compile(
    r"push over (?P<peers>\d+) peers took (?P<push_s>[\d.]+)s; assignment channel: "
    r"sent (?P<sent_frames>\d+) frames (?P<sent_bytes>\d+) bytes, "
    r"received (?P<received_frames>\d+) frames (?P<received_bytes>\d+) bytes")


def parse_push_line(text: str) -> dict[str, float] | None:
    """The coordinator's push summary (docs/bringup.md §4) as numbers, or None if it did not print one."""
    m = PUSH_LINE.search(text)
    return {k: (float(v) if k == "push_s" else int(v)) for k, v in m.groupdict().items()} if m else None


def _health(url: str) -> int:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code
    except httpx.TransportError:
        return 0


def _wait(cond: Callable[[], bool], procs: list[Any], timeout: float, what: str) -> None:
    """Poll ``cond`` every 50 ms; raise naming ``what`` (and a dead process's stderr tail) on a death or timeout."""
    deadline = time.monotonic() + timeout
    while not cond():
        dead = [p for p in procs if p.proc.poll() is not None]
        if dead or time.monotonic() > deadline:
            tail = "".join(dead[0].lines[-20:]) if dead else ""
            more = f":\n{tail}" if tail else ""
            raise RuntimeError(f"scaling_bench: {what} not reached within {timeout:g}s{more}")
        time.sleep(0.05)


def _start_peers(n: int, work: Path, common: list[str], procs: list[Any]) -> tuple[list[str], list[str]]:
    """``n`` --pp-peer processes on 127.0.0.20.. (appended to ``procs``); their control addresses and URLs."""
    from bench.bringup_bench import Proc, free_port

    controls, urls = [], []
    for i in range(n):
        host = f"127.0.0.{PEER_BASE + i}"
        control, port = f"{host}:{free_port(host)}", free_port(host)
        controls.append(control)
        urls.append(f"http://{host}:{port}")
        procs.append(Proc(work / f"peer-{i}", [*common, "--pp-peer", "--host", host, "--port", str(port),
                                                "--cluster-control-addr", control]))
    return controls, urls


def _push_fields(text: str) -> dict[str, Any]:
    push = parse_push_line(text) or {}
    return {"push_s": push.get("push_s"), **{k: push.get(k) for k in ("sent_bytes", "received_bytes", "sent_frames",
                                                                      "received_frames")},
            "wire_bytes": (push["sent_bytes"] + push["received_bytes"]) if push else None}


def bringup_point(model: Path, peers: int, work: Path, secret: Path, args: argparse.Namespace,
                  rnd: int) -> dict[str, Any]:
    """N waiting peers first (each answers /health 503 "waiting"), then t0: the coordinator starts;
    time to /health 200 and to the first token, the push line's bytes, RSS of everything."""
    from bench.bringup_bench import Proc, first_token, free_port

    common = ["-m", str(model), "--cluster-secret-file", str(secret), "--log-level", "warning", "--threads", "1",
              "--served-model-name", "bench"]
    work = work / f"n{peers}-r{rnd}"
    procs: list[Any] = []
    try:
        controls, urls = _start_peers(peers, work, common, procs)
        _wait(lambda: all(_health(u) == 503 for u in urls), procs, args.timeout, f"{peers} waiting peers")
        peer_rss = sum(x for x in (rss_bytes(p.proc.pid) for p in procs) if x)
        port = free_port(COORDINATOR_HOST)
        url = f"http://{COORDINATOR_HOST}:{port}"
        t0 = time.perf_counter()
        procs.append(Proc(work / "coordinator", [
            *common, "--pp-auto", str(peers), "--host", COORDINATOR_HOST, "--port", str(port), "--cluster-peers",
            ",".join(controls), "--cluster-control-addr", f"{COORDINATOR_HOST}:{free_port(COORDINATOR_HOST)}"]))
        _wait(lambda: _health(url) == 200, procs, args.timeout, f"the {peers}-stage coordinator serving")
        ready = time.perf_counter() - t0
        token = first_token(url)
        rss = [rss_bytes(p.proc.pid) for p in procs]
        row = {"bench": "scaling_bringup", "peers": peers, "round": rnd, "ready_s": round(ready, 3),
               "first_token_s": round(ready + token, 3), **_push_fields("".join(procs[-1].lines)),
               "peer_rss_waiting_bytes": peer_rss, "peer_rss_bytes": sum(x for x in rss[:-1] if x),
               "coordinator_rss_bytes": rss[-1], "model": model.name, "load_1m": load_1m()}
        print(f"bringup N={peers}: serving after {ready:.2f}s, push {row['push_s']}s, {row['wire_bytes']} bytes, "
              f"peers' RSS {row['peer_rss_bytes'] / 2**20:.0f} MiB", file=sys.stderr, flush=True)
        return row
    finally:
        for p in procs[::-1]:
            p.stop()


# -- router ---------------------------------------------------------------------------------------


def router_point(model: Path, prefill: int, decode: int, secret: Path, args: argparse.Namespace,
                 rnd: int) -> dict[str, Any]:
    """``<p>p<d>d`` behind a router; sequential requests: per request TTFT less the prefill node's own
    prefill seconds (the router's ``prefill_seconds`` delta), and the router's CPU less its idle rate."""
    from bench.disagg_bench import router_metrics, start_topology, stream_once

    url, procs = start_topology(f"{prefill}p{decode}d", str(model), secret, ["--parallel", "8", "--max-queue", "64"], 0)
    router = procs[-1].proc.pid
    try:
        stream_once(url, "warm up", 4)
        c0, w0 = proc_cpu_s(router), time.perf_counter()
        time.sleep(args.idle_s)
        idle_rate = (proc_cpu_s(router) - c0) / (time.perf_counter() - w0)  # type: ignore[operator]
        added, ttft = [], []
        c0, w0 = proc_cpu_s(router), time.perf_counter()
        for i in range(args.requests):
            before = router_metrics(url)
            got = stream_once(url, f"[{rnd}-{i}] Tell me about lighthouses.", args.tokens)
            after = router_metrics(url)
            prefill_ms = (after.get("router_prefill_seconds", 0) - before.get("router_prefill_seconds", 0)) * 1e3
            ttft.append(got["ttft_ms"])
            added.append(got["ttft_ms"] - prefill_ms)
        wall, cpu = time.perf_counter() - w0, proc_cpu_s(router) - c0  # type: ignore[operator]
        row = {"bench": "scaling_router", "prefill_nodes": prefill, "decode_nodes": decode, "nodes": prefill + decode,
               "round": rnd, "requests": args.requests, "max_tokens": args.tokens, "wall_s": round(wall, 4),
               "router_cpu_s": round(cpu, 4), "router_idle_cpu_s_per_s": round(idle_rate, 5),
               "router_cpu_s_per_request": round((cpu - idle_rate * wall) / args.requests, 5),
               "router_cpu_s_per_request_raw": round(cpu / args.requests, 5),
               "ttft_ms_p50": percentile(ttft, 50), "added_ms_p50": percentile(added, 50),
               "added_ms_p95": percentile(added, 95), "model": model.name, "load_1m": load_1m()}
        print(f"router {prefill}p{decode}d: {row['router_cpu_s_per_request'] * 1e3:.2f} ms CPU/request, added p95 "
              f"{row['added_ms_p95']:.1f} ms", file=sys.stderr, flush=True)
        return row
    finally:
        for p in procs[::-1]:
            p.stop()


# -- main -----------------------------------------------------------------------------------------


def _ints(text: str) -> list[int]:
    values = [int(x) for x in text.split(",") if x]
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def _topologies(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        p, sep, d = item.partition("x")
        if not sep or not p.isdigit() or not d.isdigit() or not 1 <= int(p) <= 4 or not 1 <= int(d) <= 4:
            raise argparse.ArgumentTypeError(f"topology {item!r}: expected PxD with 1..4 prefill and 1..4 decode nodes")
        out.append((int(p), int(d)))
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.scaling_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=("pipeline", "bringup", "router", "fit"))
    p.add_argument("rows", nargs="?", type=Path, help="fit: the scaling_bench.jsonl to fit")
    p.add_argument("-m", "--model", type=Path, default=None, help="checkpoint (default: a random 32-layer llama)")
    p.add_argument("--stages", type=_ints, default=[1, 2, 3, 4, 6, 8], help="pipeline depths; 1 = the single node")
    p.add_argument("--streams", type=int, default=8, help="pipeline: the concurrent level besides 1 stream")
    p.add_argument("--tokens", type=int, default=32, help="tokens per request")
    p.add_argument("--peers", type=_ints, default=[2, 4, 8, 16, 32], help="bring-up: --pp-auto N")
    p.add_argument("--topologies", type=_topologies, default=_topologies("1x1,2x2,4x4,1x4,4x1"))
    p.add_argument("--requests", type=int, default=20, help="router: sequential requests per topology")
    p.add_argument("--idle-s", type=float, default=2.0, help="router: seconds its idle CPU rate is measured over")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--timeout", type=float, default=600, help="bring-up: seconds to wait for peers / serving")
    p.add_argument("--label", default=None, help="recorded in every row")
    fit = p.add_argument_group("fit: the model and device the 16/64-host prediction is for")
    fit.add_argument("--hidden", type=int, default=3584, help="hidden size: activation bytes per hop (Qwen2.5-7B)")
    fit.add_argument("--dtype-bytes", type=int, default=2, help="bytes per activation element (bfloat16)")
    fit.add_argument("--single-ms", type=float, default=None, help="replace the measured single-node ms/token")
    fit.add_argument("--hop-ms", type=float, default=None, help="replace the measured ms per hop")
    p.add_argument("--out", type=Path, default=Path("bench/results") / time.strftime("%Y-%m-%d"))
    args = p.parse_args(argv)
    if args.mode == "fit" and args.rows is None:
        p.error("fit needs the rows file: python -m bench.scaling_bench fit bench/results/<date>/scaling_bench.jsonl")
    if args.mode == "pipeline" and max(args.stages) > 16:
        p.error("--stages: at most 16 (stage hosts 127.0.0.3-18)")
    if args.tokens < 2:
        p.error("--tokens must be at least 2 (a rate needs two tokens)")
    return args


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every point of ``args.mode`` for ``args.rounds`` rounds; the rows, stamped with label and start."""
    args.out.mkdir(parents=True, exist_ok=True)
    model = args.model.resolve() if args.model else tiny_model(REPO / "models")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix=f"scaling-{args.mode}-") as tmp:
        work = Path(tmp)
        secret = work / "cluster.secret"
        secret.write_text(os.urandom(32).hex() + "\n")
        secret.chmod(0o600)
        for rnd in range(args.rounds):
            if args.mode == "pipeline":
                for s in sweep(args.stages, rnd):
                    rows += pipeline_point(model, s, work, args, rnd)
            elif args.mode == "bringup":
                rows += [bringup_point(model, n, work, secret, args, rnd) for n in sweep(args.peers, rnd)]
            else:
                rows += [router_point(model, p, d, secret, args, rnd) for p, d in sweep(args.topologies, rnd)]
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    return [{**r, "label": args.label, "bench_started": started} for r in rows]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.mode == "fit":
        from bench.scaling_fit import fit_file

        override = {k: v for k, v in (("single_ms", args.single_ms), ("hop_ms", args.hop_ms)) if v is not None}
        print(json.dumps(fit_file(args.rows, args.hidden, args.dtype_bytes, **override), indent=1, default=str))
        return 0
    rows = run(args)
    path = write_jsonl(args.out / "scaling_bench.jsonl", rows)
    print(f"scaling_bench: {len(rows)} rows -> {path}", file=sys.stderr)
    return 1 if any(r.get("errors") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
