"""Protected against unprotected: end-to-end greedy decode of the 2-stage remote pipeline.

What AES-256-GCM on every frame costs per decoded token, measured the way the reference's headline
benchmark is (docs/benchmarks.md "Frame protection, end to end"): both stages and the coordinator in one
process over loopback, the same pipeline twice:

- ``protected``: what every cluster runs, AES-256-GCM on every frame;
- ``unprotected``: the same members built with an attribution-only token (mlxcel/cluster/attribution.py):
  the handshake still authenticates both ends, frames go unsealed. For attribution only: the token exists
  only in this process, no flag, environment variable or TOML key reaches it, and a serving process
  refuses it.

Each pipeline is a ``PipelineExecutor`` under the server's ``Scheduler`` over two ``StageService``s on
their own loopback addresses, each loading its slice of the same checkpoint (split by parameter bytes).
Both decode the same chat prompt greedily, EOS ignored, for --tokens tokens after a --warmup; --runs
rounds in ABBA order (protected first in even rounds). A row per run and mode (tok/s from the gaps
between tokens, p50/p95 step, frames and bytes per token, whether the tokens match the first run's), and
one summary row: each mode's median and range, the ratio protected/unprotected of the medians, the
per-round ratios' median, min and max (its spread), and the cost in ms per token. Every row carries the
environment (bench/environment.py) and the host's 1-minute load average.

    python -m bench.pipeline_bench protection -m models/smollm2-135m-instruct --runs 6 --tokens 48
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.environment import load_1m, write_jsonl
from bench.greedy_stream import greedy_tokens_and_gaps
from bench.stats import percentile

BENCH = "pipeline_protection"
MODES = ("protected", "unprotected")
DEFAULT_PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
HOSTS = {"protected": ("127.0.0.21", "127.0.0.22", "127.0.0.23"),
         "unprotected": ("127.0.0.24", "127.0.0.25", "127.0.0.26")}  # coordinator, stage-0, stage-1
MAX_ROWS = 2


def _free_port(host: str) -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def cluster_of(hosts: tuple[str, ...], model_dir: Path, num_layers: int) -> Any:
    """The 2-stage cluster on ``hosts`` (coordinator first), layers split by parameter bytes."""
    from mlxcel.topology.cluster_config import parse_cluster_config
    from mlxcel.topology.distributed import resolve_layers

    nodes = [{"id": "coordinator", "role": "coordinator", "address": f"{hosts[0]}:{_free_port(hosts[0])}"}]
    nodes += [{"id": f"stage-{i}", "role": "stage", "address": f"{h}:{_free_port(h)}"} for i, h in enumerate(hosts[1:])]
    doc = {"cluster": {"name": "protection-bench"}, "pipeline": {"max_batch_size": MAX_ROWS, "prefix_cache_mb": 0},
           "timeouts": {"startup_s": 120, "exchange_s": 120, "heartbeat_s": 5}, "nodes": nodes}
    return resolve_layers(parse_cluster_config(doc, Path("protection-bench.toml")), model_dir, num_layers)


@dataclass
class Pipeline:
    """One in-process 2-stage pipeline: its stages, coordinator and scheduler."""

    mode: str
    stages: list[Any]
    executor: Any
    engine: Any
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.new_event_loop)

    def wire(self) -> tuple[int, int]:
        """Frames and bytes every member sent so far (each frame on the wire is sent by exactly one)."""
        outboxes = [self.executor.outbox, *(s.outbox for s in self.stages)]
        return sum(o.frames for o in outboxes), sum(o.bytes for o in outboxes)

    def generate(self, prompt: list[int], tokens: int) -> tuple[list[int], list[float]]:
        """Greedy tokens and the seconds between consecutive ones."""
        return greedy_tokens_and_gaps(self.engine, self.loop, prompt, tokens)

    def close(self) -> None:
        self.engine.close()  # closes the executor too
        for stage in self.stages:
            stage.close()
        self.loop.close()


def build_pipeline(mode: str, model_dir: Path, tokenizer: Any) -> Pipeline:
    """Load both stage slices and start the pipeline of ``mode``; only ``unprotected`` takes the token."""
    from mlxcel.cluster.attribution import attribution_only
    from mlxcel.cluster.secret import ClusterSecret
    from mlxcel.engine.scheduler import Scheduler
    from mlxcel.models.facts import model_facts
    from mlxcel.pipeline.coordinator import PipelineExecutor
    from mlxcel.pipeline.slice_loading import load_stage_runner
    from mlxcel.pipeline.stage import StageService

    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
    token = attribution_only("bench/protection_bench.py") if mode == "unprotected" else None
    secret = ClusterSecret(os.urandom(32), source="protection bench")
    facts = model_facts(model_dir)
    cluster = cluster_of(HOSTS[mode], model_dir, facts.num_layers)
    stages = []
    try:
        for node in cluster.stages:
            runner, _ = load_stage_runner(model_dir, *node.layers, max_rows=MAX_ROWS)
            stages.append(StageService(cluster, node.id, runner, secret, facts, _attribution=token))
            stages[-1].start()
        executor = PipelineExecutor(cluster, secret, facts, max_batch_size=MAX_ROWS, _attribution=token)
        executor.start(timeout=120)
    except BaseException:
        for stage in stages:
            stage.close()
        raise
    engine = Scheduler(executor, tokenizer, context_length=8192, parallel=MAX_ROWS, warmup=False).start()
    return Pipeline(mode, stages, executor, engine)


def measure(pipe: Pipeline, prompt: list[int], tokens: int) -> dict[str, Any]:
    """One measured run: tokens, tok/s, step percentiles, wire per token, host load."""
    frames0, bytes0 = pipe.wire()
    load = load_1m()
    out, gaps = pipe.generate(prompt, tokens)
    time.sleep(0.2)  # let the release round trip land in the counters
    frames1, bytes1 = pipe.wire()
    n = max(len(out), 1)
    return {"tokens_list": out, "tokens": len(out), "tok_s": len(gaps) / sum(gaps),
            "per_token_ms_p50": percentile(gaps, 50) * 1e3, "per_token_ms_p95": percentile(gaps, 95) * 1e3,
            "frames_per_token": (frames1 - frames0) / n, "bytes_per_token": (bytes1 - bytes0) / n, "load_1m": load}


def abba(pipes: dict[str, Pipeline], prompt: list[int], runs: int, tokens: int) -> list[dict[str, Any]]:
    """``runs`` rounds of both modes, the order reversed every other round; a row per run and mode."""
    rows: list[dict[str, Any]] = []
    reference: list[int] | None = None
    for run in range(runs):
        order = list(MODES) if run % 2 == 0 else list(reversed(MODES))
        for position, mode in enumerate(order):
            res = measure(pipes[mode], prompt, tokens)
            out = res.pop("tokens_list")
            reference = reference or out
            rows.append({"bench": BENCH, "mode": mode, "run": run, "order": position, "prompt_tokens": len(prompt),
                         "identical": out == reference, **res})
            print(f"run {run} {mode:>11}: {res['tok_s']:7.2f} tok/s, step p50 {res['per_token_ms_p50']:.2f} ms, "
                  f"{res['frames_per_token']:.2f} frames/token, {res['bytes_per_token']:.0f} B/token, "
                  f"load {res['load_1m'] or 0:.2f}", flush=True)
    return rows


def summary_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians and ranges per mode, the ratio protected/unprotected of medians and of each round."""
    tps = {m: [r["tok_s"] for r in rows if r["mode"] == m] for m in MODES}
    by_run = {(r["run"], r["mode"]): r["tok_s"] for r in rows}
    ratios = [by_run[(run, "protected")] / by_run[(run, "unprotected")] for run in sorted({r["run"] for r in rows})]
    med = {m: statistics.median(v) for m, v in tps.items()}
    loads = [r["load_1m"] for r in rows if r["load_1m"] is not None]
    out: dict[str, Any] = {"bench": BENCH, "mode": "summary", "runs": len(ratios),
                           "identical": all(r["identical"] for r in rows),
                           "ratio": med["protected"] / med["unprotected"], "ratio_median": statistics.median(ratios),
                           "ratio_min": min(ratios), "ratio_max": max(ratios),
                           "cost_ms_per_token": 1e3 / med["protected"] - 1e3 / med["unprotected"],
                           "load_1m_max": max(loads) if loads else None}
    for m in MODES:
        out.update({f"{m}_tok_s": med[m], f"{m}_tok_s_min": min(tps[m]), f"{m}_tok_s_max": max(tps[m]),
                    f"{m}_bytes_per_token": statistics.median(r["bytes_per_token"] for r in rows if r["mode"] == m)})
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pipeline_bench protection", description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", default="models/smollm2-135m-instruct")
    p.add_argument("--runs", type=int, default=6, help="ABBA rounds (each runs both modes once)")
    p.add_argument("--tokens", type=int, default=48, help="greedy tokens per run (EOS ignored)")
    p.add_argument("--warmup", type=int, default=8, help="tokens each pipeline decodes before the first run")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="the user message (chat template applied)")
    p.add_argument("--label", default=None, help="free-form label recorded in every row (e.g. cpu-2core, h100)")
    p.add_argument("--out", type=Path, default=Path("bench/results") / time.strftime("%Y-%m-%d"))
    args = p.parse_args(argv)
    if args.runs < 1 or args.tokens < 2 or args.warmup < 0:
        p.error("--runs must be at least 1, --tokens at least 2 (a rate needs two tokens), --warmup at least 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import mlxcel  # noqa: F401  (before mlx.core: picks up OpenBLAS, see mlxcel/blas.py)
    from mlxcel.engine.prompts import encode_chat
    from mlxcel.models.loading import load_checkpoint

    model = Path(args.model).resolve()
    tokenizer = load_checkpoint(model, lazy=True).tokenizer
    prompt = encode_chat(tokenizer, [{"role": "user", "content": args.prompt}])
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    pipes: dict[str, Pipeline] = {}
    try:
        for mode in MODES:
            pipes[mode] = build_pipeline(mode, model, tokenizer)
            if args.warmup:
                pipes[mode].generate(prompt, args.warmup)
        rows = abba(pipes, prompt, args.runs, args.tokens)
    finally:
        for pipe in pipes.values():
            pipe.close()
    rows.append(summary_row(rows))
    for row in rows:
        row.update(model=model.name, stages=2, tokens_requested=args.tokens, label=args.label, bench_started=started)
    path = write_jsonl(args.out / "pipeline_protection.jsonl", rows)
    s = rows[-1]
    print(f"\nrows: {path}\nprotected {s['protected_tok_s']:.2f} tok/s ({s['protected_tok_s_min']:.2f}-"
          f"{s['protected_tok_s_max']:.2f}), unprotected {s['unprotected_tok_s']:.2f} tok/s "
          f"({s['unprotected_tok_s_min']:.2f}-{s['unprotected_tok_s_max']:.2f}); protected/unprotected "
          f"{s['ratio']:.3f} (per round {s['ratio_min']:.3f}-{s['ratio_max']:.3f}), "
          f"{s['cost_ms_per_token']:+.2f} ms/token; identical tokens: {s['identical']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
