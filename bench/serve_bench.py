"""Serving load benchmark: N concurrent streaming chat clients against any OpenAI-compatible server.

    python -m bench.serve_bench --url http://127.0.0.1:8080 --concurrency 1,2,4,8
    python -m bench.serve_bench --launch mlxcel,mlx_lm --model-dir models/smollm2-135m-instruct
    python -m bench.serve_bench --url http://127.0.0.2:8080 --api-key-file api.key   # a keyed server

Each concurrency level runs N closed-loop clients, each sending ``--requests``
streaming chat requests one after another. Per request it records the time to
first token (TTFT), the gaps between streamed tokens (ITL) and output tok/s;
per level the percentiles, aggregate output tok/s (all tokens / wall time) and
errors. Rows go to JSONL (with the environment) and CSV. ``--launch`` starts
every named server on the same checkpoint and compares them side by side under the
same background load; mlx_lm.server is started with the same BLAS as mlxcel.

Fairness: every server gets the same prompts (request texts depend only on the round,
level, client and request index, never on the server or the clock; rows carry their
SHA-256 as ``prompts_sha256``), and the order alternates at every level, ABBA: a level's
first server in one round goes second in the next, and consecutive levels flip too
(``order`` in the rows is the position within the level). The default two rounds give
every level one A-B and one B-A measurement.

API keys: ``--api-key-file`` (else ``MLXCEL_API_KEY_FILE``) names a file in the server's format (one key
a line, ``#`` comments); its first key goes out as ``Authorization: Bearer``. The key is never printed;
a 401 stops the run with one line that says so.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.environment import load_1m, write_jsonl
from bench.stats import percentile

PROMPTS = [
    "Explain in a few sentences why the sky is blue.",
    "Write a short poem about the sea.",
    "List three tips for learning a new programming language.",
    "What is the difference between a list and a tuple in Python?",
    "Describe how a bicycle works.",
    "Give me a recipe for a simple tomato soup.",
    "Why do cats purr?",
    "Summarize the plot of a detective story in three sentences.",
]
DEFAULT_OUT = Path("bench/results")
ENV_KEY_FILE = "MLXCEL_API_KEY_FILE"  # the server's variable for the same file


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    tokens: int = 0
    gaps: list[float] = field(default_factory=list)
    error: str = ""


async def one_request(client: httpx.AsyncClient, url: str, body: dict) -> RequestResult:
    """Stream one chat completion; a content chunk counts as a token unless usage says otherwise."""
    start = time.perf_counter()
    times: list[float] = []
    usage_tokens = None
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return RequestResult(False, error=f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    return RequestResult(False, error=str(data["error"])[:200])
                if data.get("usage"):
                    usage_tokens = data["usage"].get("completion_tokens")
                for choice in data.get("choices") or []:
                    if (choice.get("delta") or {}).get("content"):
                        times.append(time.perf_counter())
    except httpx.HTTPError as exc:
        return RequestResult(False, error=f"{type(exc).__name__}: {exc}")
    if not times:
        return RequestResult(False, error="no tokens streamed")
    gaps = [b - a for a, b in zip(times, times[1:])]
    return RequestResult(True, ttft=times[0] - start, e2e=times[-1] - start,
                         tokens=usage_tokens or len(times), gaps=gaps)


def request_text(tag: str, concurrency: int, idx: int, k: int) -> str:
    """Request ``k`` of client ``idx``: a tag unique within one server's run, then a stock prompt.

    The tag keeps any server from answering from a cached copy of an earlier prompt, while the chat
    template's preamble (system prompt) stays shared, as in real traffic. It depends only on its
    arguments, so every server of a side-by-side run gets exactly the same texts.
    """
    return f"[{tag}-{idx}-{k}] {PROMPTS[(idx + k * concurrency) % len(PROMPTS)]}"


def prompts_sha256(tag: str, concurrency: int, requests: int) -> str:
    """SHA-256 over every request text of one level, in client and request order."""
    h = hashlib.sha256()
    for idx in range(concurrency):
        for k in range(requests):
            h.update(request_text(tag, concurrency, idx, k).encode() + b"\n")
    return h.hexdigest()


def level_order(kinds: list[str], rnd: int, level_index: int) -> list[str]:
    """Which server goes first at this level: flips every level and every round (ABBA)."""
    return list(kinds) if (rnd + level_index) % 2 == 0 else list(kinds)[::-1]


async def run_level(url: str, model: str, concurrency: int, requests: int, max_tokens: int,
                    ignore_eos: bool, stagger_s: float = 0.0, tag: str = "level",
                    headers: dict[str, str] | None = None,
                    extra_body: dict[str, Any] | None = None) -> tuple[list[RequestResult], float]:
    """N closed-loop clients, each sending ``requests`` requests; returns results and wall time.

    With ``stagger_s`` > 0 client i starts i * stagger_s / N seconds late, so arrivals are spread
    as in steady-state traffic instead of landing together (a "herd" whose prompts all prefill
    at once: then the last TTFT is at least N single prefills, whatever the server does).
    """
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600), limits=limits, headers=headers) as client:

        async def worker(idx: int) -> list[RequestResult]:
            out = []
            await asyncio.sleep(idx * stagger_s / concurrency)
            for k in range(requests):
                text = request_text(tag, concurrency, idx, k)
                body = {"model": model, "stream": True, "stream_options": {"include_usage": True},
                        "messages": [{"role": "user", "content": text}],
                        "max_tokens": max_tokens, "temperature": 0.0}
                if ignore_eos:
                    body["ignore_eos"] = True
                body.update(extra_body or {})  # --extra-body: e.g. penalties and logit_bias
                out.append(await one_request(client, url, body))
            return out

        start = time.perf_counter()
        per_worker = await asyncio.gather(*(worker(i) for i in range(concurrency)))
        wall = time.perf_counter() - start
    return [r for rs in per_worker for r in rs], wall


def summarize(server: str, url: str, concurrency: int, results: list[RequestResult], wall: float,
              max_tokens: int) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    gaps = [g for r in ok for g in r.gaps]
    per_req = [r.tokens / r.e2e for r in ok if r.e2e > 0]
    tokens = sum(r.tokens for r in ok)
    ms = lambda v: None if v is None else round(v * 1000, 1)  # noqa: E731
    return {
        "bench": "serve", "server": server, "url": url, "concurrency": concurrency,
        "requests": len(results), "errors": len(results) - len(ok),
        "error_sample": next((r.error for r in results if not r.ok), ""),
        "max_tokens": max_tokens, "output_tokens": tokens, "wall_s": round(wall, 2),
        "ttft_p50_ms": ms(percentile([r.ttft for r in ok], 50)), "ttft_p95_ms": ms(percentile([r.ttft for r in ok], 95)),
        "itl_p50_ms": ms(percentile(gaps, 50)), "itl_p95_ms": ms(percentile(gaps, 95)),
        "req_tps_mean": round(sum(per_req) / len(per_req), 2) if per_req else None,
        "agg_tps": round(tokens / wall, 2) if wall > 0 else None,
    }


# -- API key ------------------------------------------------------------------------------------


def read_api_key(path: str | None, env: dict[str, str] | None = None) -> str | None:
    """The first key of ``path``, else of $MLXCEL_API_KEY_FILE; None where neither is given.

    The server's format: one key a line, blank lines and ``#`` comments skipped. Errors name the
    file and where it came from, never its content.
    """
    env = os.environ if env is None else env
    source = "--api-key-file"
    if not path:
        path, source = env.get(ENV_KEY_FILE) or None, ENV_KEY_FILE
    if not path:
        return None
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise SystemExit(f"serve_bench: cannot read the API key file {path} (from {source}): "
                         f"{getattr(exc, 'strerror', None) or type(exc).__name__}") from None
    key = next((line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")), "")
    if not key:
        raise SystemExit(f"serve_bench: no API key in {path} (from {source})")
    return key


class AuthHeaders(dict):
    """The request headers that carry the key: repr and str never show it (args, tracebacks)."""

    def __repr__(self) -> str:
        return f"AuthHeaders({'<redacted>' if self else ''})"

    __str__ = __repr__


def auth_headers(key: str | None) -> AuthHeaders:
    return AuthHeaders({"Authorization": f"Bearer {key}"} if key else {})


def unauthorized(url: str, keyed: bool) -> SystemExit:
    """The one-line error for a 401: a wrong key, or a server that wants one."""
    if keyed:
        return SystemExit(f"serve_bench: {url} answered 401 Unauthorized: the server refused the API key "
                          f"(--api-key-file / {ENV_KEY_FILE})")
    return SystemExit(f"serve_bench: {url} answered 401 Unauthorized: the server needs an API key "
                      f"(--api-key-file FILE or {ENV_KEY_FILE})")


# -- launching servers ----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# mlxcel-sync / mlxcel-async: mlxcel with MLXCEL_ASYNC_SCHED=0 / 1 (the synchronous scheduler / asynchronous
# scheduling wherever it applies, a CPU included); mlxcel-lone-tails: MLXCEL_BATCH_TAILS=0 (every prompt's last token a prompt step of its own,
# as before batched tails); mlxcel: its defaults (asynchronous on a GPU with batched tails, the plain join)
# (mlxcel-stable, MLXCEL_STABLE_JOIN=1, went with the switch: issue 41)
KINDS = ("mlxcel", "mlxcel-sync", "mlxcel-async", "mlxcel-lone-tails", "mlx_lm")
_SWITCHES = {"mlxcel-sync": ("MLXCEL_ASYNC_SCHED", "0"), "mlxcel-async": ("MLXCEL_ASYNC_SCHED", "1"),
             "mlxcel-lone-tails": ("MLXCEL_BATCH_TAILS", "0")}


def launch_env(kind: str, step_trace: str | None = None) -> dict[str, str]:
    """The environment a launched server gets: this one, plus the engine switch and trace of mlxcel kinds."""
    env = dict(os.environ)
    if kind in _SWITCHES:
        name, value = _SWITCHES[kind]
        env[name] = value
    if kind.startswith("mlxcel") and step_trace:
        path = Path(step_trace).resolve()
        env["MLXCEL_STEP_TRACE"] = str(path if kind == "mlxcel" else path.with_name(f"{path.stem}-{kind}{path.suffix}"))
    return env


def launch_command(kind: str, model_dir: str, port: int, parallel: int) -> list[str]:
    cache = re.fullmatch(r"mlxcel-cache(\d+)", kind)  # mlxcel with --mlx-cache-mb N
    if kind.startswith("mlxcel") and (kind in KINDS or cache):
        return [sys.executable, "-c", "import sys; from mlxcel.cli import main; sys.exit(main())", "serve",
                "-m", model_dir, "--port", str(port), "--parallel", str(parallel), "--log-level", "warning",
                *(["--mlx-cache-mb", cache.group(1)] if cache else [])]
    if kind == "mlx_lm":
        # importing mlxcel first loads the same OpenBLAS mlxcel uses (see mlxcel/blas.py): a fair comparison
        code = ("import mlxcel, runpy, sys; sys.argv = ['mlx_lm.server'] + sys.argv[1:]; "
                "runpy.run_module('mlx_lm.server', run_name='__main__')")
        return [sys.executable, "-c", code, "--model", model_dir, "--port", str(port), "--host", "127.0.0.1",
                "--decode-concurrency", str(parallel), "--prompt-concurrency", str(parallel),
                "--log-level", "WARNING"]
    raise SystemExit(f"serve_bench: unknown server kind {kind!r} ({', '.join(KINDS)})")


def wait_until_serving(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    """Until /health answers 200 (ours: 503 while loading), or /v1/models where there is no /health."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"serve_bench: server exited with {proc.returncode}")
        try:
            health = httpx.get(url + "/health", timeout=5).status_code
            if health == 200 or (health == 404 and httpx.get(url + "/v1/models", timeout=5).status_code == 200):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit("serve_bench: server did not become ready")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def model_name(url: str, kind: str | None, model_dir: str | None, headers: dict[str, str] | None = None) -> str:
    if kind == "mlx_lm":
        return "default_model"  # mlx_lm.server's name for the model given on its command line
    if kind and kind.startswith("mlxcel") and model_dir:
        return Path(model_dir).resolve().name
    reply = httpx.get(f"{url}/v1/models", timeout=10, headers=headers)
    if reply.status_code == 401:
        raise unauthorized(url, bool(headers))
    models = reply.json().get("data") or []
    if not models:
        raise SystemExit(f"serve_bench: {url}/v1/models lists no model; pass --model-name")
    return models[0]["id"]


# -- driver -------------------------------------------------------------------------------------


def warm(url: str, model: str, headers: dict[str, str] | None = None) -> None:
    """One short request: loads lazy weights and code paths before anything is measured; a 401 stops here."""
    results, _ = asyncio.run(run_level(url, model, 1, 1, 8, False, tag="warm", headers=headers))
    if results and results[0].error.startswith("HTTP 401"):
        raise unauthorized(url, bool(headers))


def single_request_seconds(url: str, model: str, args: argparse.Namespace, tag: str) -> float:
    """End-to-end time of one request alone: the period over which --arrival staggered spreads clients."""
    results, wall = asyncio.run(run_level(url, model, 1, 1, args.max_tokens, args.ignore_eos, tag=tag,
                                          headers=args.headers))
    return wall


def bench_level(label: str, url: str, model: str, n: int, args: argparse.Namespace, tag: str) -> dict[str, Any]:
    """One concurrency level against one server; ``tag`` names the prompts (same tag, same texts)."""
    stagger = single_request_seconds(url, model, args, f"{tag}-solo") if args.arrival == "staggered" and n > 1 else 0.0
    sampler = GpuUtil.start() if args.gpu_util else None
    try:
        results, wall = asyncio.run(run_level(url, model, n, args.requests, args.max_tokens, args.ignore_eos, stagger,
                                              tag, headers=args.headers, extra_body=args.extra_body))
    finally:
        util = sampler.stop() if sampler is not None else None
    row = summarize(label, url, n, results, wall, args.max_tokens)
    if util is not None:
        row.update(util)
    row.update(arrival=args.arrival, prompt_tag=tag, prompts_sha256=prompts_sha256(tag, n, args.requests))
    if args.extra_body:
        row["extra_body"] = args.extra_body
    return row


class GpuUtil:
    """``nvidia-smi`` sampling GPU utilisation and memory used every 100 ms while a level runs (GPU 0, or
    $GPU_UTIL_INDEX)."""

    COMMAND = ["nvidia-smi", "--query-gpu=utilization.gpu,memory.used", "--format=csv,noheader,nounits", "-lms", "100"]

    def __init__(self, proc: subprocess.Popen | None):
        self.proc = proc

    @classmethod
    def start(cls) -> "GpuUtil":
        command = cls.COMMAND + ["-i", os.environ.get("GPU_UTIL_INDEX", "0")]
        try:
            return cls(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True))
        except OSError:  # no nvidia-smi (a CPU rehearsal): the rows say no samples
            return cls(None)

    def stop(self) -> dict[str, Any]:
        """Stop sampling; the level's samples summarised (mean, p50, count; None where nvidia-smi gave none)."""
        if self.proc is None:
            return gpu_util_fields("")
        self.proc.terminate()
        try:
            out, _ = self.proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
        return gpu_util_fields(out)


def gpu_util_fields(text: str) -> dict[str, Any]:
    """``nvidia-smi`` output (a line per sample: utilisation %, then MiB used) as row fields."""
    fields = [[x.strip() for x in line.split(",")] for line in text.splitlines()]
    number = lambda x: x.replace(".", "", 1).isdigit()  # noqa: E731
    samples = [float(f[0]) for f in fields if f and number(f[0])]
    used = [float(f[1]) for f in fields if len(f) > 1 and number(f[1])]
    mean = round(sum(samples) / len(samples), 1) if samples else None
    return {"gpu_util_mean": mean, "gpu_util_p50": percentile(samples, 50) if samples else None,
            "gpu_util_samples": len(samples), "gpu_mem_max_mib": max(used) if used else None}


def format_row(row: dict[str, Any], rounds: int) -> str:
    """One level's progress line, labelled with its round (the levels repeat once per round)."""
    return (f"round {row['round'] + 1}/{rounds} {row['server']:>8} c={row['concurrency']:<2} req={row['requests']:<3} "
            f"err={row['errors']:<2} ttft p50/p95 {row['ttft_p50_ms']}/{row['ttft_p95_ms']} ms  itl p50/p95 "
            f"{row['itl_p50_ms']}/{row['itl_p95_ms']} ms  per-req {row['req_tps_mean']} tok/s  aggregate {row['agg_tps']} tok/s"
            + (f"  gpu {row['gpu_util_mean']}%" if "gpu_util_mean" in row else ""))


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists()
    with path.open("a", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        if new:
            writer.writeheader()
        writer.writerows(rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="serve_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8080", help="server to load (ignored with --launch)")
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8],
                   help="comma-separated client counts (default 1,2,4,8)")
    p.add_argument("--requests", type=int, default=3, help="requests per client per level (default 3)")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens per request (default 64)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="send ignore_eos (mlxcel/vLLM extension) for fixed output lengths")
    p.add_argument("--extra-body", type=json.loads, default=None,
                   help='JSON object merged into every request, e.g. \'{"presence_penalty": 0.5, "logit_bias": {"9": 2}}\'')
    p.add_argument("--arrival", choices=["herd", "staggered"], default="herd",
                   help="herd: all clients start together; staggered: client starts spread over one "
                        "single-stream request time (steady-state arrivals)")
    p.add_argument("--model-name", default=None, help="model id to request (default: from /v1/models)")
    p.add_argument("--launch", default=None,
                   help="start these servers in turn (comma): mlxcel, mlxcel-sync / mlxcel-async "
                        "(MLXCEL_ASYNC_SCHED=0 / 1), mlxcel-lone-tails "
                        "(MLXCEL_BATCH_TAILS=0), mlxcel-cacheN (--mlx-cache-mb N), mlx_lm")
    p.add_argument("--model-dir", default="models/smollm2-135m-instruct", help="checkpoint for --launch")
    p.add_argument("--parallel", type=int, default=8, help="concurrent sequences of launched servers (default 8)")
    p.add_argument("--rounds", type=int, default=2,
                   help="repeat all levels; launched servers alternate order at every level and round, "
                        "so two rounds give each level an A-B and a B-A run (default 2)")
    p.add_argument("--label", default=None, help="server label in the rows (default: the launch kind or 'server')")
    p.add_argument("--api-key-file", default=None,
                   help=f"send the first key of this file as the Bearer token (default: ${ENV_KEY_FILE}, if set)")
    p.add_argument("--warm-levels", action="store_true",
                   help="before timing, send every server one short request per client at each level's concurrency")
    p.add_argument("--gpu-util", action="store_true",
                   help="sample GPU utilisation (nvidia-smi, every 100 ms) during every level into the rows")
    p.add_argument("--step-trace", default=None,
                   help="a launched mlxcel server writes its scheduler timeline here (MLXCEL_STEP_TRACE; "
                        "summarise with python -m bench.step_trace FILE)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})")
    args = p.parse_args(argv)
    args.headers = auth_headers(read_api_key(args.api_key_file))
    return args


def warm_levels(servers: dict[str, tuple[str, str]], args: argparse.Namespace) -> None:
    """One unrecorded short request per client at every level's concurrency, on every server: the batch
    shapes a level decodes compile their kernels here (a GPU), not inside its first timed round."""
    for label, (url, name) in servers.items():
        for n in args.concurrency:
            asyncio.run(run_level(url, name, n, 1, 8, args.ignore_eos, tag=f"warm-{n}", headers=args.headers))


def run_side_by_side(servers: dict[str, tuple[str, str]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every level against every server ``{label: (url, model)}``, same prompts, ABBA order: on a
    shared machine, load from elsewhere then hits all alike instead of whichever ran during a busy minute."""
    labels = list(servers)
    rows: list[dict[str, Any]] = []
    if args.warm_levels:
        warm_levels(servers, args)
    for rnd in range(args.rounds):
        for j, n in enumerate(args.concurrency):
            for order, label in enumerate(level_order(labels, rnd, j)):
                url, name = servers[label]
                row = {**bench_level(label, url, name, n, args, tag=f"r{rnd}-c{n}"), "round": rnd, "order": order,
                       "load_1m": load_1m()}  # the host's load after the level: other jobs on a shared box
                print(format_row(row, args.rounds), file=sys.stderr, flush=True)
                rows.append(row)
    return rows


def run_launched(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Start every named server on the same checkpoint, warm each, then run_side_by_side."""
    kinds = args.launch.split(",")
    procs: list[subprocess.Popen] = []
    servers: dict[str, tuple[str, str]] = {}
    try:
        for kind in kinds:
            port = _free_port()
            url = f"http://127.0.0.1:{port}"
            proc = subprocess.Popen(launch_command(kind, args.model_dir, port, args.parallel),
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                    env=launch_env(kind, args.step_trace))
            procs.append(proc)
            wait_until_serving(url, proc)
            servers[kind] = (url, args.model_name or model_name(url, kind, args.model_dir))
            warm(*servers[kind], headers=args.headers)
        rows = run_side_by_side(servers, args)
    finally:
        for proc in procs:
            stop(proc)
    return [{**r, "model_dir": args.model_dir} for r in rows]


def ratios(rows: list[dict[str, Any]], baseline: str = "mlx_lm") -> list[dict[str, Any]]:
    """Per level and server: aggregate tok/s over ``baseline``'s in the same round (ABBA pairs), as the
    mean of the rounds' ratios with their range, and the mean GPU utilisation where it was sampled."""
    out = []
    for n in dict.fromkeys(r["concurrency"] for r in rows):
        level = [r for r in rows if r["concurrency"] == n]
        base = {r["round"]: r["agg_tps"] for r in level if r["server"] == baseline and r["agg_tps"]}
        for server in dict.fromkeys(r["server"] for r in level):
            mine = [r for r in level if r["server"] == server]
            pairs = [r["agg_tps"] / base[r["round"]] for r in mine if r["round"] in base and r["agg_tps"]]
            utils = [r["gpu_util_mean"] for r in mine if r.get("gpu_util_mean") is not None]
            used = [r["gpu_mem_max_mib"] for r in mine if r.get("gpu_mem_max_mib") is not None]
            out.append({"bench": "serve_ratio", "server": server, "baseline": baseline, "concurrency": n,
                        "agg_tps_mean": round(sum(r["agg_tps"] or 0 for r in mine) / len(mine), 2),
                        "ratio_mean": round(sum(pairs) / len(pairs), 3) if pairs else None,
                        "ratio_min": round(min(pairs), 3) if pairs else None,
                        "ratio_max": round(max(pairs), 3) if pairs else None,
                        "gpu_util_mean": round(sum(utils) / len(utils), 1) if utils else None,
                        "gpu_mem_max_mib": max(used) if used else None})  # the whole GPU's, every server on it
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.launch:
        rows = run_launched(args)
    else:
        name = args.model_name or model_name(args.url, None, None, args.headers)
        warm(args.url, name, args.headers)
        rows = run_side_by_side({args.label or "server": (args.url, name)}, args)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    summary = ratios(rows) if any(r["server"] == "mlx_lm" for r in rows) else []
    for r in summary:
        print(f"c={r['concurrency']:<3} {r['server']:>11} {r['agg_tps_mean']:>9} tok/s  x mlx_lm {r['ratio_mean']} "
              f"({r['ratio_min']}-{r['ratio_max']})" + (f"  gpu {r['gpu_util_mean']}%" if r["gpu_util_mean"] else ""),
              file=sys.stderr)
    write_jsonl(args.out / "serve_bench.jsonl", [{**r, "run": stamp} for r in rows])
    if summary:  # a file of its own: the report reads serve_bench.jsonl's rows as levels
        write_jsonl(args.out / "serve_ratio.jsonl", [{**r, "run": stamp} for r in summary])
    write_csv(args.out / f"serve_bench-{stamp}.csv", rows)
    print(f"serve_bench: {len(rows)} rows -> {args.out}/serve_bench.jsonl, serve_bench-{stamp}.csv", file=sys.stderr)
    return 1 if any(r["errors"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
