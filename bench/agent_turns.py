"""Multi-turn agent benchmark: growing tool-call conversations, TTFT per turn, prefix reuse, decode tok/s.

    python -m bench.agent_turns --conversations 4 --turns 8 --repeats 2          # today's variants
    python -m bench.agent_turns --preset full                                     # each also with --kv-bits 8
    python -m bench.agent_turns --variant single=single --variant rr='2p1d;router:--route-policy round-robin'
    python -m bench.agent_turns --url http://127.0.0.2:8080 --label deployed      # a running server, no launch

Every variant is a topology started here on loopback through the real CLI: ``single`` (one ``mlxcel serve``),
``pp<N>`` (a coordinator and N stages, as ``bench/cluster_abba.py`` starts them) or ``<p>p<d>d[-options]``
(router + p prefill + d decode nodes, as ``bench/disagg_bench.py`` starts them), plus per-role arguments:
``NAME=TOPOLOGY[;ROLE:ARGS]...`` with ROLE one of all, server, coordinator, stage, prefill, decode, router
(``server`` is the single node). Each (variant, repeat) starts fresh processes (an empty prefix cache: identical
inputs meet identical state) and stops them after; the order of variants flips every repeat (ABBA).

Per turn, the ``--conversations`` conversations send their next request together (a wave); per request a row
records TTFT, prompt and completion tokens and decode tok/s, and per wave the prefix-cache tokens the serving
processes reused (their ``/metrics`` counters' delta: the single node, the coordinator, or the prefill nodes)
against the tokens the previous turn's prompts held. Rows (``bench: agent_turns``) go to
``--out``/agent_turns.jsonl with the environment, plus a summary row per variant and a ratio row per ``--pair``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import httpx

from bench import agent_conv as conv
from bench import cluster_abba, disagg_bench, serve_bench
from bench.environment import load_1m, write_jsonl

ROLES = ("all", "server", "coordinator", "stage", "prefill", "decode", "router")
MODEL_NAME = "bench"  # every launched process serves the checkpoint under this name
_ROUTED = (("single", "single", ""), ("pipeline", "pp2", ""),
           ("round-robin", "2p1d", ";router:--route-policy round-robin"),
           ("prefix", "2p1d", ";router:--route-policy prefix"))
PRESETS = {
    # each topology once: the single node, the pipeline, the router with either prefill choice (docs/disagg.md §6)
    "today": [f"{name}={topo}{route}" for name, topo, route in _ROUTED],
    # and each again with 8-bit KV on every role
    "full": [f"{name}{kv}={topo}{';all:--kv-bits 8' if kv else ''}{route}" for kv in ("", "-kv8")
             for name, topo, route in _ROUTED],
}
DEFAULT_PAIRS = [("round-robin", "prefix"), ("round-robin-kv8", "prefix-kv8")]
PREFIX_TOKENS = "mlxcel_prefix_cache_reused_tokens_total"
PREFIX_HITS = "mlxcel_prefix_cache_hits_total"


@dataclass(frozen=True)
class Variant:
    """A named topology and the extra arguments of each role (``all`` goes to every role)."""

    name: str
    topology: str
    args: dict[str, list[str]] = field(default_factory=dict)

    def role(self, role: str) -> list[str]:
        return [*self.args.get("all", []), *self.args.get(role, [])]

    def describe(self) -> str:
        return ";".join(f"{r}:{shlex.join(a)}" for r, a in self.args.items())


def parse_variant(text: str) -> Variant:
    """``NAME=TOPOLOGY[;ROLE:ARGS]...``; a clear error for an unknown topology or role."""
    name, sep, rest = text.partition("=")
    topology, *parts = rest.split(";")
    if not sep or not name.strip() or not topology.strip():
        raise ValueError(f"agent_turns: variant {text!r} is not NAME=TOPOLOGY[;ROLE:ARGS]...")
    topology = topology.strip()
    check_topology(topology)
    args: dict[str, list[str]] = {}
    for part in parts:
        role, colon, extra = part.partition(":")
        if not colon or role.strip() not in ROLES:
            raise ValueError(f"agent_turns: variant {name!r}: {part!r} is not ROLE:ARGS with ROLE one of "
                             f"{', '.join(ROLES)}")
        args.setdefault(role.strip(), []).extend(shlex.split(extra))
    return Variant(name.strip(), topology, args)


CACHE_ROLES = ("server", "coordinator", "prefill")  # the roles that keep a prefix cache


def with_cache_size(v: Variant, mib: int | None) -> Variant:
    """``v`` with ``--prefix-cache-mb mib`` given to every role that keeps a prefix cache (unchanged for None)."""
    if mib is None:
        return v
    extra = {role: [*v.args.get(role, []), "--prefix-cache-mb", str(mib)] for role in CACHE_ROLES}
    return Variant(v.name, v.topology, {**v.args, **extra})


def check_topology(topology: str) -> None:
    if topology == "single" or (topology.startswith("pp") and topology[2:].isdigit() and int(topology[2:]) >= 1):
        return
    try:
        base, _, _ = disagg_bench.topology_options(topology)
    except SystemExit as exc:
        raise ValueError(str(exc)) from None
    head, _, tail = base.partition("p")
    if not (head.isdigit() and tail.endswith("d") and tail[:-1].isdigit() and int(head) and int(tail[:-1])):
        raise ValueError(f"agent_turns: unknown topology {topology!r} (single, pp<N>, or <p>p<d>d[-options])")


# -- launching ------------------------------------------------------------------------------------


@dataclass
class Running:
    """A started topology: its serving URL, the URLs whose /metrics count its prefix reuse, how to stop it."""

    url: str
    metrics_urls: list[str]
    stop: Callable[[], None]


def _stop_all(procs: list[Any]) -> Callable[[], None]:
    """Stop ``procs`` last first (Popen through serve_bench.stop, disagg_bench.Proc through its own stop)."""
    def stop() -> None:
        for p in procs[::-1]:
            if isinstance(p, disagg_bench.Proc):
                p.stop()
            else:
                serve_bench.stop(p)
    return stop


def launch(v: Variant, model: str, common: list[str], hosts: list[str], work: Path) -> Running:
    """Start ``v``'s processes and wait until it serves."""
    if v.topology == "single":
        port = disagg_bench.free_port(hosts[0])
        proc = cluster_abba.server(["-m", model, "--served-model-name", MODEL_NAME, *common, *v.role("server")],
                                   hosts[0], port, work / f"{v.name}.log")
        run = Running(f"http://{hosts[0]}:{port}", [f"http://{hosts[0]}:{port}"], _stop_all([proc]))
        _ready(run, proc)
        return run
    if v.topology.startswith("pp"):
        stages = int(v.topology[2:])
        ns = argparse.Namespace(model=model, server_args=shlex.join([*common, *v.role("coordinator")]))
        url, procs = cluster_abba.start_cluster(ns, work, v.name, hosts[1:2 + stages], {},
                                                stage_args=v.role("stage"))
        run = Running(url, [url], _stop_all(procs))
        _ready(run, procs[-1])
        return run
    secret = work / f"{v.name}.secret"
    secret.write_text(os.urandom(32).hex() + "\n")
    secret.chmod(0o600)
    roles = {r: v.role(r) for r in ("prefill", "decode", "router")}
    url, procs = disagg_bench.start_topology(v.topology, model, secret, common, 0, role_args=roles)
    decodes = int(disagg_bench.topology_options(v.topology)[0].split("p")[1].rstrip("d"))
    return Running(url, [p.url for p in procs[decodes:-1]], _stop_all(procs))


def _ready(run: Running, proc: subprocess.Popen) -> None:
    try:
        serve_bench.wait_until_serving(run.url, proc, 600)
    except BaseException:
        run.stop()
        raise


# -- driving --------------------------------------------------------------------------------------


async def one_turn(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """Stream one request: TTFT (first streamed content, reasoning or tool-call delta), end to end, usage."""
    start = time.perf_counter()
    first = None
    usage: dict[str, Any] = {}
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return {"error": f"HTTP {r.status_code}: {(await r.aread())[:300].decode(errors='replace')}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    return {"error": str(data["error"])[:300]}
                usage = data.get("usage") or usage
                deltas = [c.get("delta") or {} for c in data.get("choices") or []]
                if first is None and any(d.get(k) for d in deltas for k in ("content", "reasoning_content",
                                                                             "tool_calls")):
                    first = time.perf_counter()
    except httpx.HTTPError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    end = time.perf_counter()
    if first is None:
        return {"error": "no token streamed"}
    completion = int(usage.get("completion_tokens") or 0)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return {"ttft_ms": round((first - start) * 1000, 2), "e2e_ms": round((end - start) * 1000, 2),
            "prompt_tokens": usage.get("prompt_tokens"), "completion_tokens": completion, "cached_tokens": cached,
            "decode_tps": round((completion - 1) / (end - first), 2) if completion > 1 and end > first else None}


async def prefix_counters(client: httpx.AsyncClient, urls: list[str]) -> tuple[float, float] | None:
    """(hits, reused tokens) summed over ``urls``' /metrics; None where any of them does not answer or lacks the
    counters (not measured, which is not the same as nothing reused)."""
    hits = tokens = 0.0
    for url in urls:
        try:
            text = (await client.get(f"{url}/metrics", timeout=10)).text
        except httpx.HTTPError:
            return None
        found = dict(line.partition(" ")[::2] for line in text.splitlines() if line.startswith("mlxcel_prefix_cache"))
        if PREFIX_HITS in found and PREFIX_TOKENS in found:
            hits, tokens = hits + float(found[PREFIX_HITS]), tokens + float(found[PREFIX_TOKENS])
            continue
        health = await health_counters(client, url)  # a prefill node reports its cache on /health (docs/disagg.md §8)
        if health is None:
            return None
        hits, tokens = hits + health[0], tokens + health[1]
    return hits, tokens


async def health_counters(client: httpx.AsyncClient, url: str) -> tuple[float, float] | None:
    """(prefix_hits, prefix_tokens) from a prefill node's /health, or None where it has no such fields."""
    try:
        body = (await client.get(f"{url}/health", timeout=10)).json()
    except (httpx.HTTPError, ValueError):
        return None
    if not isinstance(body, dict) or "prefix_hits" not in body or "prefix_tokens" not in body:
        return None
    return float(body["prefix_hits"]), float(body["prefix_tokens"])


def prompt_sha256(body: dict[str, Any]) -> str:
    """The request's input (messages and tools): equal across variants for the same conversation and turn."""
    return hashlib.sha256(json.dumps([body["messages"], body.get("tools")], sort_keys=True).encode()).hexdigest()


async def run_conversations(run: Running, shape: conv.Shape, wire: str, max_tokens: int, model: str = MODEL_NAME,
                            headers: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Every turn as a wave of all conversations at once; a row per request."""
    rows: list[dict[str, Any]] = []
    previous = [0] * shape.conversations
    limits = httpx.Limits(max_connections=shape.conversations + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900), limits=limits, headers=headers) as client:
        for turn in range(shape.turns):
            bodies = [conv.request_body(shape, c, turn, wire, model, max_tokens)
                      for c in range(shape.conversations)]
            before = await prefix_counters(client, run.metrics_urls)
            got = await send_wave(client, run.url, bodies, turn)
            after = await prefix_counters(client, run.metrics_urls)
            wave = {"wave_cached_tokens": None if before is None or after is None else int(after[1] - before[1]),
                    "wave_hits": None if before is None or after is None else int(after[0] - before[0]),
                    "wave_reusable_tokens": sum(previous)}
            for c, (body, res) in enumerate(zip(bodies, got)):
                rows.append({"conversation": c, "turn": turn + 1, "prompt_sha256": prompt_sha256(body),
                             "reusable_tokens": previous[c], **wave, "ttft_ms": None, "e2e_ms": None,
                             "prompt_tokens": None, "completion_tokens": None, "cached_tokens": None,
                             "decode_tps": None, "error": "", **res, "load_1m": load_1m()})
                previous[c] = res.get("prompt_tokens") or 0
    return rows


#: seconds between a wave's request starts, so they reach the server in the order send_wave chose
WAVE_GAP_S = 0.02


async def send_wave(client: httpx.AsyncClient, url: str, bodies: list[dict[str, Any]], turn: int,
                    gap_s: float = WAVE_GAP_S) -> list[dict[str, Any]]:
    """Every conversation's request of one turn, nearly at once: they leave ``gap_s`` apart in an order that
    rotates by one each turn (a fixed order would let a round-robin router keep each conversation on one node by
    the wave's arithmetic: 4 conversations on 2 nodes). The results come back in conversation order."""
    order = wave_order(len(bodies), turn)

    async def start(position: int, c: int) -> dict[str, Any]:
        await asyncio.sleep(position * gap_s)
        return await one_turn(client, url, bodies[c])

    got = await asyncio.gather(*(start(position, c) for position, c in enumerate(order)))
    return [got[order.index(c)] for c in range(len(bodies))]


def wave_order(conversations: int, turn: int) -> list[int]:
    """The conversations in the order their turn ``turn`` (0-based) requests leave: rotated by ``turn``."""
    return [(turn + k) % conversations for k in range(conversations)]


def probe_wire(url: str, model: str = MODEL_NAME, headers: dict[str, str] | None = None) -> str:
    """``native`` where the server takes OpenAI tools for this checkpoint, else ``text`` (a 400 says it knows none)."""
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "tools": conv.TOOLS, "tool_choice": "none"}
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120, headers=headers)
    if reply.status_code == 200:
        return "native"
    if reply.status_code == 400:
        return "text"
    raise SystemExit(f"agent_turns: {url}: the tools probe answered HTTP {reply.status_code}: {reply.text[:300]}")


def warm(url: str, model: str = MODEL_NAME, headers: dict[str, str] | None = None) -> None:
    """A short unrelated request (not the system prompt: turn 1 must stay cold)."""
    asyncio.run(serve_bench.run_level(url, model, 1, 1, 4, True, tag="agent-warm", headers=headers))


# -- the run --------------------------------------------------------------------------------------


def run_variant(v: Variant, args: argparse.Namespace, work: Path) -> tuple[list[dict[str, Any]], str]:
    """Start ``v`` (or use --url), warm it, decide the wire once per run, drive the conversations, stop it."""
    if args.url:
        run = Running(args.url, [args.url, *args.metrics_url], lambda: None)
    else:
        run = launch(v, args.model, shlex.split(args.common_args), args.hosts, work)
    try:
        warm(run.url, args.model_name, args.headers)
        if args.wire == "auto":
            args.wire = probe_wire(run.url, args.model_name, args.headers)
        return asyncio.run(run_conversations(run, args.shape, args.wire, args.max_tokens, args.model_name,
                                             args.headers)), run.url
    finally:
        run.stop()


def run_all(args: argparse.Namespace, keep: Callable[[list[dict[str, Any]]], None] = lambda rows: None
            ) -> list[dict[str, Any]]:
    """Every variant per repeat, the order flipping each repeat; fresh processes each time. ``keep`` gets each
    (variant, repeat)'s rows as soon as they exist, so a run stopped early keeps what it measured."""
    rows: list[dict[str, Any]] = []
    fixed = {"bench": "agent_turns", "mode": "turn", "label": args.label, "model": Path(args.model).name,
             "conversations": args.shape.conversations, "turns": args.shape.turns, "max_tokens": args.max_tokens,
             "seed": args.shape.seed, "system_words": args.shape.system_words,
             "result_words": args.shape.result_words}
    with tempfile.TemporaryDirectory(prefix="agent-turns-") as tmp:
        for rep in range(args.repeats):
            order = args.variants if rep % 2 == 0 else args.variants[::-1]
            for position, v in enumerate(order):
                got, url = run_variant(v, args, Path(tmp))
                done = [{**fixed, "variant": v.name, "topology": v.topology, "args": v.describe(), "repeat": rep,
                         "order": position, "wire": args.wire, **r} for r in got]
                rows += done
                keep(done)
                later = [r["ttft_ms"] for r in got if r["turn"] >= 2 and r["ttft_ms"] is not None]
                errors = [r["error"] for r in got if r["error"]]
                print(f"agent_turns: repeat {rep + 1}/{args.repeats} {v.name:>16} ({url}): turn 1 TTFT "
                      f"{_median([r['ttft_ms'] for r in got if r['turn'] == 1])} ms, turns >= 2 {_median(later)} ms, "
                      f"errors {len(errors)}{f' (first: {errors[0][:200]})' if errors else ''}",
                      file=sys.stderr, flush=True)
    return rows


def _median(xs: list[Any]) -> float | None:
    present = [x for x in xs if x is not None]
    return round(statistics.median(present), 1) if present else None


def _pair(text: str) -> tuple[str, str]:
    num, sep, den = text.partition("/")
    if not sep or not num or not den:
        raise argparse.ArgumentTypeError(f"{text!r} is not NUMERATOR/DENOMINATOR (variant names)")
    return num, den


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.agent_turns", description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", default="models/smollm2-135m-instruct")
    p.add_argument("--preset", choices=sorted(PRESETS), default="today", help="the variants when no --variant is given")
    p.add_argument("--variant", action="append", default=[], help="NAME=TOPOLOGY[;ROLE:ARGS]... (repeatable)")
    p.add_argument("--baseline", default="single", help="the variant whose later turns the others are held against")
    p.add_argument("--pair", type=_pair, action="append", default=None,
                   help="NUM/DEN: a ratio row of later-turn TTFT (default: round-robin/prefix and their -kv8)")
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--system-words", type=int, default=300, help="the system prompt's notes (plus the tool schemas)")
    p.add_argument("--result-words", type=int, default=300, help="each tool result (SmolLM2: ~1.3 tokens a word)")
    p.add_argument("--max-prompt-tokens", type=int, default=7680,
                   help="refuse a shape whose last prompt would be longer (SmolLM2's context is 8192)")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--wire", choices=["auto", *conv.WIRES], default="auto",
                   help="native OpenAI tools, or the same conversation as plain text (auto: probe the first server)")
    p.add_argument("--common-args", default="--parallel 4 --max-queue 64", help="given to every launched role")
    p.add_argument("--hosts", type=lambda s: s.split(","), default=[f"127.0.0.{i}" for i in range(181, 186)],
                   help="the single node, then the pipeline's coordinator and stages")
    p.add_argument("--url", default=None, help="drive a running server instead (one variant, --label names it)")
    p.add_argument("--metrics-url", action="append", default=[], help="with --url: more /metrics to sum (prefill nodes)")
    p.add_argument("--model-name", default=None, help="with --url: the model id (default: from /v1/models)")
    p.add_argument("--api-key-file", default=None, help="with --url: send its first key (serve_bench's format)")
    p.add_argument("--prefix-cache-mb", type=int, default=None,
                   help="given to the roles that keep a prefix cache (server, coordinator, prefill); the default "
                        "256 MiB holds ~2k tokens of a Qwen3-0.6B shape, too few for long conversations")
    p.add_argument("--label", default="", help="recorded in every row")
    p.add_argument("--out", type=Path, default=Path("bench/results") / time.strftime("%Y-%m-%d"))
    args = p.parse_args(argv)
    try:
        args.shape = conv.Shape(args.conversations, args.turns, args.system_words, args.result_words, args.seed)
        args.variants = [with_cache_size(parse_variant(t), args.prefix_cache_mb)
                         for t in args.variant or PRESETS[args.preset]]
    except ValueError as exc:
        p.error(str(exc))
    names = [v.name for v in args.variants]
    if len(set(names)) != len(names):
        p.error(f"agent_turns: variant names repeat: {', '.join(names)}")
    args.headers = serve_bench.auth_headers(serve_bench.read_api_key(args.api_key_file)) if args.url else None
    if args.url:
        args.variants = [Variant(args.label or "server", "external")]
        args.model_name = args.model_name or serve_bench.model_name(args.url, None, None, args.headers)
    else:
        args.model_name = MODEL_NAME
    args.pairs = args.pair or DEFAULT_PAIRS
    return args


def check_length(args: argparse.Namespace) -> None:
    """Refuse, before starting anything, a shape whose last prompt would not fit --max-prompt-tokens."""
    count = disagg_bench._token_counter(args.model)
    if count is None:
        return
    worst = max(conv.estimated_tokens(args.shape, w, count) for w in conv.WIRES if args.wire in ("auto", w))
    if worst > args.max_prompt_tokens:
        raise SystemExit(f"agent_turns: the last turn's prompt would be about {worst} tokens, over --max-prompt-tokens "
                         f"{args.max_prompt_tokens}: fewer --turns or --result-words")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    check_length(args)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = args.out / "agent_turns.jsonl"

    def keep(rows: list[dict[str, Any]]) -> None:  # each variant's turn rows as soon as they exist
        write_jsonl(path, [{**r, "run": stamp, "model_dir": args.model} for r in rows])

    rows = run_all(args, keep)
    fixed = {k: rows[0][k] for k in ("bench", "label", "model", "conversations", "turns", "max_tokens", "wire")}
    summary = [{**fixed, **s} for s in conv.summaries(rows, args.baseline, args.pairs)]
    for s in summary:
        print("agent_turns:", json.dumps(s), file=sys.stderr)
    out = write_jsonl(path, [{**s, "run": stamp, "model_dir": args.model} for s in summary])
    print(f"agent_turns: {len(rows)} turn rows, {len(summary)} summary rows -> {out}", file=sys.stderr)
    return 1 if any(r["error"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
