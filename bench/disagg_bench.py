"""Disaggregated inference: the KV handoff per request, and serving against a single node.

    python -m bench.disagg_bench handoff --prompt-tokens 64,512,1024,2048      # bytes and time per handoff
    python -m bench.disagg_bench serve --topologies hybrid,1p1d,1p2d --concurrency 1,4,8 [--long]
    python -m bench.disagg_bench frames --prompt-tokens 98,898,2048    # protected vs unprotected handoffs
    python -m bench.disagg_bench stages --shape qwen3-0.6b --prompt-tokens 1500   # where a handoff's time goes
    python -m bench.disagg_bench e2e --shape qwen3-0.6b --prompt-tokens 1500      # export -> stream -> import

Every topology is started through the real CLI on its own 127.0.0.x addresses (``--node-role``,
``--serving-bind``, one cluster secret), decode nodes first, then prefill nodes, then the router.

``handoff``: one prefill and one decode node behind a router, and a hybrid node, on the same
checkpoint. For each prompt length, requests of ``--max-tokens`` greedy tokens go to both, the
order alternating ABBA; per request a row records the client's TTFT and end-to-end time on each,
and for the router the handoff's bytes, the prefill node's stream time (first part sent to
STREAM_END sent) and the GENERATE-to-first-token time, read from ``/router/stats`` (requests run
one at a time, so the deltas belong to that request).

``serve``: ``bench/serve_bench.py``'s side-by-side driver (same prompts for every topology, ABBA
order per level) over the topologies; each row gains the router's handoff count, bytes and seconds
over its level. A topology ``<p>p<d>d-lanes<N>`` runs its prefill nodes with ``MLXCEL_HANDOFF_LANES=N``
(``1p1d-lanes1`` against ``1p1d``: one connection per decode node against the host's default),
``-copy`` its decode nodes with ``MLXCEL_HANDOFF_COPY=1`` (handoffs copied into MLX at import; ``-stable``,
``MLXCEL_STABLE_JOIN=1``, went with the switch in issue 41), ``-staged`` / ``-unstaged`` both roles with ``MLXCEL_HANDOFF_STAGING=1`` / ``0``
(page-locked staging, on by default on CUDA), ``-switch5`` both roles with ``MLXCEL_SWITCH_INTERVAL_MS=5``
(Python's own GIL switch interval), ``-p0`` both roles with ``MLXCEL_CRYPTO_PIPELINE_MIN_LEN=0`` (crypto helpers on
every fragmented message, as before 2026-12-04); options combine (``1p1d-copy-lanes1``). ``--long`` replaces serve_bench's stock prompts with ones of about
``--long-tokens`` tokens (default 1100).

``frames``: the large-frame cost of a handoff, without a model: two transports in this process
(127.0.0.76 -> .77), the default model's KV layout (30 layers, 3 KV heads of 64, float32 or with
``--dtype bfloat16``), synthetic tensors. One handoff = the prefill side's real path (``encode_header``,
``encode_chunks``, one transport stream) to the decode side's real ``HandoffDecoder`` until
``result()``; timed end to end, AES-256-GCM against the unprotected suite in alternating rounds.

``stages`` and ``e2e`` (``bench/handoff_stages.py``): real mlx-lm caches of ``--shape`` (``qwen3-0.6b``:
28 layers, 8 KV heads of 128, bfloat16; ``smollm2``), each stage of a handoff timed alone, and the whole
path (export, AES-256-GCM or unprotected stream, decoder, import) end to end; ``--heap plain`` measures
them on glibc's default heap (each round's tensor buffers on fresh pages) instead of the decode node's.

Rows go to ``--out``/disagg_bench.jsonl (with the environment) and a CSV beside it; each row records
the host's 1-minute load average when it was measured (``load_1m``: other jobs on a shared box and
this benchmark's own processes).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from functools import lru_cache
from pathlib import Path
from typing import Any

import httpx

from bench.environment import load_1m, write_jsonl

ROUTER_IP, HYBRID_IP = "127.0.0.70", "127.0.0.69"
PREFILL_IPS = ("127.0.0.71", "127.0.0.72", "127.0.0.73", "127.0.0.74")  # a topology spans .69-.78 (offsets of 10)
DECODE_IPS = ("127.0.0.75", "127.0.0.76", "127.0.0.77", "127.0.0.78")
FILLER = ("The quick brown fox jumps over the lazy dog while the river runs past old stone bridges "
          "and the wind carries leaves across quiet fields. ")


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Proc:
    """One ``mlxcel serve`` process; ``url`` is its HTTP address."""

    def __init__(self, args: list[str], host: str, env: dict[str, str] | None = None):
        port = free_port(host)
        cmd = [sys.executable, "-m", "mlxcel", "serve", "--host", host, "--port", str(port), "--log-level", "warning",
               *args]
        self.url = f"http://{host}:{port}"
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     env={**os.environ, **(env or {})})

    def wait(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"disagg_bench: {self.url} exited with {self.proc.returncode}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise SystemExit(f"disagg_bench: {self.url} did not become ready")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


#: a topology's options (``1p1d-copy-lanes2``): the environment they give the prefill or the decode nodes
DECODE_OPTIONS = {"copy": ("MLXCEL_HANDOFF_COPY", "1")}


def topology_options(name: str) -> tuple[str, dict[str, str], dict[str, str]]:
    """``<p>p<d>d`` and its ``-`` options: ``lanes<N>`` (the prefill nodes' MLXCEL_HANDOFF_LANES), ``switch<ms>``
    (both roles' MLXCEL_SWITCH_INTERVAL_MS), ``staged`` / ``unstaged`` (both roles' MLXCEL_HANDOFF_STAGING=1 / 0),
    ``p0`` (both roles' MLXCEL_CRYPTO_PIPELINE_MIN_LEN=0),
    ``copy`` (the decode nodes' MLXCEL_HANDOFF_COPY=1)."""
    base, *options = name.split("-")
    prefill: dict[str, str] = {}
    decode: dict[str, str] = {}
    for opt in options:
        if opt.startswith("lanes") and opt[5:].isdigit():
            prefill["MLXCEL_HANDOFF_LANES"] = opt[5:]
        elif opt.startswith("switch") and opt[6:].replace(".", "", 1).isdigit():
            prefill["MLXCEL_SWITCH_INTERVAL_MS"] = decode["MLXCEL_SWITCH_INTERVAL_MS"] = opt[6:]
        elif opt == "p0":  # both roles' crypto helpers on every fragmented message (before the 4 MiB threshold)
            prefill["MLXCEL_CRYPTO_PIPELINE_MIN_LEN"] = decode["MLXCEL_CRYPTO_PIPELINE_MIN_LEN"] = "0"
        elif opt in ("staged", "unstaged"):  # both roles' page-locked staging on or off (the default: on CUDA)
            prefill["MLXCEL_HANDOFF_STAGING"] = decode["MLXCEL_HANDOFF_STAGING"] = "1" if opt == "staged" else "0"
        elif opt in DECODE_OPTIONS:
            key, value = DECODE_OPTIONS[opt]
            decode[key] = value
        else:
            raise SystemExit(f"disagg_bench: unknown topology option {opt!r} in {name!r} "
                             "(lanesN, switchMS, copy, stable, staged, unstaged, p0)")
    return base, prefill, decode


def start_topology(name: str, model: str, secret: Path, common: list[str], offset: int,
                   role_args: dict[str, list[str]] | None = None) -> tuple[str, list[Proc]]:
    """``hybrid`` or ``<p>p<d>d`` with ``topology_options``: returns the serving URL and the processes (decode
    nodes, prefill nodes, the router last); ``role_args`` adds arguments per role (prefill, decode, router)."""
    extra = role_args or {}
    base = ["-m", model, "--served-model-name", "bench", *common]
    name, prefill_env, decode_env = topology_options(name)
    if name == "hybrid":
        p = Proc([*base, "--node-role", "hybrid"], HYBRID_IP)
        p.wait()
        return p.url, [p]
    prefills, decodes = int(name.split("p")[0]), int(name.split("p")[1].rstrip("d"))
    role = ["--cluster-secret-file", str(secret)]
    procs: list[Proc] = []
    ip = lambda ips, i: ips[i].rsplit(".", 1)[0] + "." + str(int(ips[i].rsplit(".", 1)[1]) + offset)  # noqa: E731
    try:
        dec = [f"{ip(DECODE_IPS, i)}:{free_port(ip(DECODE_IPS, i))}" for i in range(decodes)]
        pre = [f"{ip(PREFILL_IPS, i)}:{free_port(ip(PREFILL_IPS, i))}" for i in range(prefills)]
        for addr in dec:
            procs.append(Proc([*base, *role, "--node-role", "decode", "--serving-bind", addr,
                               *extra.get("decode", ())], addr.split(":")[0], decode_env))
        for addr in pre:
            procs.append(Proc([*base, *role, "--node-role", "prefill", "--serving-bind", addr, "--decode-peers",
                               dec[0], *extra.get("prefill", ())], addr.split(":")[0], prefill_env))
        for p in procs:
            p.wait()
        router_ip = ip((ROUTER_IP,), 0)
        raddr = f"{router_ip}:{free_port(router_ip)}"
        router = Proc([*base, *role, "--node-role", "router", "--serving-bind", raddr, "--prefill-peers",
                       ",".join(pre), "--decode-peers", ",".join(dec), *extra.get("router", ())], router_ip)
        procs.append(router)
        router.wait()
    except BaseException:
        for p in procs:
            p.stop()
        raise
    return router.url, procs


def router_metrics(url: str) -> dict[str, float]:
    try:
        reply = httpx.get(f"{url}/router/stats", timeout=10)
    except httpx.HTTPError:
        return {}
    return reply.json().get("metrics", {}) if reply.status_code == 200 else {}


def long_prompt(tokens: int, tag: str, model: str | None = None) -> str:
    """About ``tokens`` prompt tokens of English, counted with ``model``'s own tokenizer when given.

    Without a model it assumes SmolLM2's ~1.25 tokens per word; a random checkpoint's byte-level
    tokenizer takes ~5 tokens per word, so its prompts are sized by counting."""
    words = FILLER.split()

    def text(n: int) -> str:
        return f"[{tag}] " + " ".join(words[i % len(words)] for i in range(max(1, n))) + "\nSummarize the text above."

    guess = int(tokens / 1.25)
    count = _token_counter(model)
    if count is None:
        return text(guess)
    lo, hi = 1, max(2, guess) * 8  # the largest word count whose prompt stays within ``tokens``
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if count(text(mid)) <= tokens else (lo, mid - 1)
    return text(lo)


@lru_cache(maxsize=4)
def _token_counter(model: str | None):
    """``len(tokenizer.encode(text))`` for the checkpoint at ``model``, or None when it has no tokenizer."""
    if not model or not (Path(model) / "tokenizer.json").exists():
        return None
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model) / "tokenizer.json"))
    return lambda text: len(tok.encode(text).ids)


def stream_once(url: str, prompt: str, max_tokens: int) -> dict[str, float]:
    body = {"model": "bench", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = None
    usage: dict[str, int] = {}
    import json

    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            raise SystemExit(f"disagg_bench: {url}: HTTP {r.status_code}: {r.read().decode(errors='replace')[:2000]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                raise SystemExit(f"disagg_bench: {url}: {data['error']}")
            if data.get("usage"):
                usage = data["usage"]
            if first is None and any((c.get("delta") or {}).get("content") for c in data.get("choices") or []):
                first = time.perf_counter()
    end = time.perf_counter()
    return {"ttft_ms": round(((first or end) - start) * 1000, 2), "e2e_ms": round((end - start) * 1000, 2),
            "prompt_tokens": usage.get("prompt_tokens", 0), "completion_tokens": usage.get("completion_tokens", 0)}


def run_handoff(args: argparse.Namespace, secret: Path, common: list[str]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    started: dict[str, tuple[str, list[Proc]]] = {}
    try:
        for k, topo in enumerate(("hybrid", "1p1d")):
            started[topo] = start_topology(topo, args.model, secret, common, k * 10)
        for url, _ in started.values():
            stream_once(url, "warm up", 4)
        for length in args.prompt_tokens:
            for rep in range(args.repeats):
                order = ["hybrid", "1p1d"] if rep % 2 == 0 else ["1p1d", "hybrid"]
                for position, topo in enumerate(order):
                    url = started[topo][0]
                    before = router_metrics(url) if topo != "hybrid" else {}
                    got = stream_once(url, long_prompt(length, f"h{length}-{rep}", args.model), args.max_tokens)
                    row: dict[str, Any] = {"bench": "disagg_handoff", "topology": topo, "target_prompt_tokens": length,
                                           "repeat": rep, "order": position, **got, "load_1m": load_1m()}
                    if topo != "hybrid":
                        after = router_metrics(url)
                        d = {k: after.get(f"router_{k}", 0) - before.get(f"router_{k}", 0)
                             for k in ("handoffs", "handoff_bytes", "handoff_seconds", "prefill_seconds")}
                        row.update(handoff_bytes=int(d["handoff_bytes"]), handoff_ms=round(d["handoff_seconds"] * 1000, 3),
                                   prefill_ms=round(d["prefill_seconds"] * 1000, 2), handoffs=int(d["handoffs"]),
                                   bytes_per_prompt_token=round(d["handoff_bytes"] / max(1, got["prompt_tokens"]), 1),
                                   handoff_gib_s=round(d["handoff_bytes"] / max(d["handoff_seconds"], 1e-9) / 2**30, 3))
                    print("disagg_bench:", row, file=sys.stderr, flush=True)
                    rows.append(row)
    finally:
        for _, procs in started.values():
            for p in procs:
                p.stop()
    return rows


def run_serve(args: argparse.Namespace, secret: Path, common: list[str]) -> list[dict[str, Any]]:
    from bench import serve_bench

    if args.long:  # serve_bench's request texts come from its PROMPTS list: lengthen them for this run
        serve_bench.PROMPTS = [long_prompt(args.long_tokens, f"long{i}", args.model) for i in range(len(serve_bench.PROMPTS))]
    sb_args = serve_bench.parse_args(["--concurrency", args.concurrency, "--requests", str(args.requests),
                                      "--max-tokens", str(args.max_tokens), "--rounds", str(args.rounds),
                                      "--ignore-eos"])
    started: dict[str, tuple[str, list[Proc]]] = {}
    try:
        for k, topo in enumerate(args.topologies.split(",")):
            started[topo] = start_topology(topo, args.model, secret, common, k * 10)
            serve_bench.warm(started[topo][0], "bench")
        servers = {topo: (url, "bench") for topo, (url, _) in started.items()}
        rows = []
        for rnd in range(sb_args.rounds):
            for j, n in enumerate(sb_args.concurrency):
                for order, topo in enumerate(serve_bench.level_order(list(servers), rnd, j)):
                    url = servers[topo][0]
                    before = router_metrics(url)
                    row = {**serve_bench.bench_level(topo, url, "bench", n, sb_args, tag=f"r{rnd}-c{n}"),
                           "round": rnd, "order": order, "bench": "disagg_serve", "topology": topo,
                           "prompt": "long" if args.long else "short", "load_1m": load_1m(),
                           "long_tokens": args.long_tokens if args.long else None}
                    after = router_metrics(url)
                    if after:
                        d = {k: after.get(f"router_{k}", 0) - before.get(f"router_{k}", 0)
                             for k in ("handoffs", "handoff_bytes", "handoff_seconds")}
                        row.update(handoffs=int(d["handoffs"]), handoff_bytes=int(d["handoff_bytes"]),
                                   handoff_ms_mean=round(d["handoff_seconds"] * 1000 / max(1, d["handoffs"]), 3),
                                   handoff_bytes_mean=int(d["handoff_bytes"] / max(1, d["handoffs"])))
                    print(serve_bench.format_row(row, sb_args.rounds), row.get("handoff_bytes_mean", ""),
                          row.get("handoff_ms_mean", ""), file=sys.stderr, flush=True)
                    rows.append(row)
    finally:
        for _, procs in started.values():
            for p in procs:
                p.stop()
    return rows


def smollm2_layout(dtype: str):
    """The default model's KV layout (SmolLM2-135M: 30 layers, 3 KV heads, head width 64)."""
    from mlxcel.disagg.kv_codec import KVLayout, LayerSpec, dtype_code
    from mlxcel.disagg.wire import CacheKind

    return KVLayout(tuple(LayerSpec(CacheKind.KV, dtype_code(dtype), 3, 64, 64) for _ in range(30)))


def run_frames(args: argparse.Namespace) -> list[dict[str, Any]]:
    import threading

    import numpy as np

    from mlxcel.cluster.secret import ClusterSecret
    from mlxcel.cluster.transport import Transport
    from mlxcel.cluster.wire import Kind, Suite
    from mlxcel.disagg.kv_codec import HandoffDecoder, encode_chunks, encode_header

    from bench.stats import percentile

    layout = smollm2_layout(args.dtype)
    secret = ClusterSecret(os.urandom(32))
    rows: list[dict[str, Any]] = []
    suites = {"unprotected": Suite.UNPROTECTED, "aes": Suite.AES_256_GCM}
    pairs = {}
    for name, suite in suites.items():
        done = threading.Event()
        state: dict[str, Any] = {}

        def on_message(msg: Any, state: dict = state, done: threading.Event = done) -> None:
            if msg.kind is Kind.STREAM_DATA:
                if "dec" not in state:
                    state["dec"] = HandoffDecoder(layout, 8192)
                state["dec"].feed(msg.payload)
            elif msg.kind is Kind.STREAM_END:
                state.pop("dec").result()
                done.set()

        rx = Transport("127.0.0.77:0", secret, suite=suite)
        rx.serve(on_message=on_message)
        tx = Transport("127.0.0.76:0", secret, suite=suite)
        tx.connect(rx.identity)
        pairs[name] = (tx, rx, done)
    try:
        for tokens in args.prompt_tokens:
            tensors = [np.random.default_rng(0).integers(0, 255, t.nbytes, dtype=np.uint8)
                       for t in layout.tensors(tokens)]
            header = encode_header({"nonce": "0" * 16}, tuple(range(tokens)), layout)
            times: dict[str, list[float]] = {name: [] for name in suites}
            for rnd in range(args.repeats):
                for name in (list(suites) if rnd % 2 == 0 else list(suites)[::-1]):
                    tx, rx, done = pairs[name]
                    done.clear()
                    start = time.perf_counter()
                    with tx.open_stream(rx.identity) as stream:
                        stream.write(header)
                        for part in encode_chunks(tensors):
                            stream.write(part)
                    if not done.wait(60):
                        raise SystemExit("disagg_bench: a handoff did not arrive")
                    times[name].append(time.perf_counter() - start)
            nbytes = layout.nbytes(tokens)
            base = percentile(times["unprotected"], 50)
            for name, samples in times.items():
                p50 = percentile(samples, 50)
                row = {"bench": "disagg_frames", "suite": name, "dtype": args.dtype, "prompt_tokens": tokens,
                       "tensor_bytes": nbytes, "repeats": len(samples), "p50_ms": round(p50 * 1000, 3),
                       "p95_ms": round(percentile(samples, 95) * 1000, 3),
                       "gib_s": round(nbytes / p50 / 2**30, 3), "vs_unprotected": round(p50 / base, 3),
                       "cpus": os.cpu_count(), "load_1m": load_1m()}
                print("disagg_bench:", row, file=sys.stderr, flush=True)
                rows.append(row)
    finally:
        for tx, rx, _ in pairs.values():
            tx.close()
            rx.close()
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.disagg_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=["handoff", "serve", "frames", "stages", "e2e"])
    p.add_argument("-m", "--model", default="models/smollm2-135m-instruct")
    p.add_argument("--prompt-tokens", type=lambda s: [int(x) for x in s.split(",")], default=[64, 512, 1024, 2048])
    p.add_argument("--repeats", type=int, default=2, help="handoff: requests per prompt length and topology")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--topologies", default="hybrid,1p1d,1p2d")
    p.add_argument("--concurrency", default="1,4,8")
    p.add_argument("--requests", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--long", action="store_true", help="serve: prompts of about --long-tokens tokens")
    p.add_argument("--long-tokens", type=int, default=1100)
    p.add_argument("--parallel", type=int, default=8)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="frames: the KV dtype of the synthetic layout")
    p.add_argument("--shape", default="qwen3-0.6b", help="stages, e2e: qwen3-0.6b or smollm2")
    p.add_argument("--suites", default="aes,unprotected", help="e2e: comma list of aes, unprotected, each with -staged (page-locked staging) and -p0 (helpers at every message size)")
    p.add_argument("--heap", choices=["keep", "plain"], default="keep",
                   help="stages, e2e: keep freed heap memory resident as a decode node does, or glibc's defaults")
    p.add_argument("--lanes", type=int, default=1,
                   help="e2e: split each handoff over this many connections (docs/disagg.md §4.9; rows record it)")
    p.add_argument("--crypto-workers", type=int, default=None, help="e2e: helper threads per transport (default: auto)")
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    secret = Path(os.environ.get("TMPDIR", "/tmp")) / f"disagg-bench-{os.getpid()}.secret"
    secret.write_text(os.urandom(32).hex() + "\n")
    secret.chmod(0o600)
    common = ["--parallel", str(args.parallel), "--max-queue", "64"]
    try:
        if args.mode in ("stages", "e2e"):
            from bench import handoff_stages as hs

            rows = [r for n in args.prompt_tokens for r in (
                hs.stages(args.shape, n, args.repeats, args.heap) if args.mode == "stages" else
                hs.e2e(args.shape, n, args.repeats, args.suites.split(","), args.crypto_workers, args.heap,
                       args.lanes))]
            for r in rows:
                print("disagg_bench:", r, file=sys.stderr, flush=True)
        elif args.mode == "frames":
            rows = run_frames(args)
        else:
            rows = run_handoff(args, secret, common) if args.mode == "handoff" else run_serve(args, secret, common)
    finally:
        secret.unlink(missing_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    rows = [{**r, "model_dir": args.model, "run": stamp} for r in rows]
    write_jsonl(args.out / "disagg_bench.jsonl", rows)
    import csv

    path = args.out / f"disagg_bench-{args.mode}-{stamp}.csv"
    keys = sorted({k for r in rows for k in r})
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)
    print(f"disagg_bench: {len(rows)} rows -> {args.out}/disagg_bench.jsonl, {path.name}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
