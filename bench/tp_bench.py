"""Tensor-parallel decode benchmark: tp 1 against tp N, mlxcel's path and mlx-lm's own ``shard()``.

For every batch size (--batch, default 1,8) and implementation (--impl):

- ``mlxcel``: the engine's path. tp 1 is ``LocalExecutor`` (a single node); tp N is rank 0's
  ``TPExecutor`` with N-1 followers it starts itself (``mlxcel.parallel``: the control channel over
  the authenticated transport, followers replaying each step). The driver prepares B sequences,
  prefills each, then times decode steps of all B rows (one batched forward per step).
- ``mlx-lm``: mlx-lm's ``Model.shard(group)`` run SPMD, the way mlx-lm's own sharded generation runs:
  every rank loads, shards and runs the same batched greedy loop (a [B, 1] forward on a plain KV
  cache, argmax, eval); no control channel. tp 1 is the same loop unsharded.

--variants names the two configurations compared (default ``tp1,model``: one process against tp N):

- ``tp1``: one process, unsharded;
- ``model``, ``bfloat16``, ``float32``: tp N with ``--tp-reduce-dtype`` of that name (the all-reduces
  carry the model's dtype, or the partial sums cast to bfloat16 / float32);
- ``one-reduce``, ``no-reduce`` (``--impl mlx-lm`` only; timing only, the output is wrong): tp N with
  the attention output's all-reduce left out (the one collective per layer a parallel-residual family
  would need), or both left out (the compute alone). They bound what fewer collectives could save.

Every measurement is a fresh process (``python -m bench.tp_bench --worker JSON``, one JSON line on
stdout; its followers are its own children), and the two variants alternate A B B A within each
round, so drift on a shared machine hits both sides alike. Rows (JSONL, with the environment) carry
the aggregate decode tok/s (B x steps / seconds), the step time p50/p95 and a digest of the greedy
tokens (rows x steps), so a variant that changes the output shows.

    python -m bench.tp_bench -m models/smollm2-135m-instruct --tp 3 --batch 1,8 --rounds 2 \
        --out bench/results/$(date +%F)/tp_bench_cpu.jsonl
    python -m bench.tp_bench -m /tmp/tiny --tp 2 --variants model,bfloat16 --rounds 3 --out ...

On NVIDIA GPUs: ``--tp-backend nccl`` (rank r uses GPU r).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
IMPLS = ("mlxcel", "mlx-lm")
REDUCE_VARIANTS = ("model", "bfloat16", "float32")  # --tp-reduce-dtype
TIMING_ONLY = ("one-reduce", "no-reduce")  # collectives left out: wrong output, mlx-lm's loop only
VARIANTS = ("tp1", *REDUCE_VARIANTS, *TIMING_ONLY)
WORKER_TIMEOUT_S = 600
PROMPT_LEN = 16


def _prompt(vocab: int, b: int) -> list[int]:
    """A fixed prompt per row (different rows, same length), inside any vocabulary."""
    return [3 + ((b * 131 + i * 17) % (vocab - 4)) for i in range(PROMPT_LEN)]


def _digest(tokens: list) -> str:
    return hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]


def _percentile(xs: list[float], q: float) -> float:
    from bench.stats import percentile

    return float(percentile(xs, q) or 0.0)


# -- the mlxcel path ---------------------------------------------------------------------------


class _Waiter:
    def __init__(self) -> None:
        self.event = threading.Event()
        self.outcome: Any = None

    def done(self, step: Any, outcome: Any) -> None:
        self.outcome = outcome
        self.event.set()

    def result(self) -> Any:
        self.event.wait()
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome


def _run_steps(executor: Any, batch: int, vocab: int, warmup: int, steps: int) -> tuple[list[float], list]:
    from mlxcel.engine.executor import Step
    from mlxcel.engine.sampling import SamplingParams

    rids = [f"r{b}" for b in range(batch)]
    last = []
    for b, rid in enumerate(rids):
        prompt = _prompt(vocab, b)
        executor.prepare(rid, SamplingParams(max_tokens=warmup + steps + 1), 0, prompt)
        w = _Waiter()
        executor.submit(Step("prefill", [rid], [prompt]), w.done)
        last.append(w.result()[0].token)
    times, tokens = [], [list(last)]
    for i in range(warmup + steps):
        w = _Waiter()
        start = time.perf_counter()
        executor.submit(Step("decode", list(rids), [[t] for t in last], slot=0), w.done)
        last = [s.token for s in w.result()]
        tokens.append(last)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    for rid in rids:
        executor.release(rid)
    return times, tokens


def worker_mlxcel(job: dict) -> dict:
    from mlxcel.models.loading import load_checkpoint

    model_dir, tp, batch = Path(job["model"]), job["tp"], job["batch"]
    if tp == 1:
        from mlxcel.engine.executor import LocalExecutor

        loaded = load_checkpoint(model_dir)
        executor: Any = LocalExecutor(loaded.model, max_batch_size=batch, prefix_cache_bytes=0)
        times, tokens = _run_steps(executor, batch, loaded.config["vocab_size"], job["warmup"], job["steps"])
        executor.close()
        return {"times": times, "tokens": tokens}
    from mlxcel.parallel.options import TPOptions
    from mlxcel.parallel.plan import check_shardable
    from mlxcel.parallel.session import RankZero

    loaded = load_checkpoint(model_dir, lazy=True)
    options = TPOptions(size=tp, plan=check_shardable(loaded.config, tp, model_dir), backend=job["backend"],
                        timeout=120.0, reduce_dtype=job["variant"])
    rank0 = RankZero(options, model_dir, None, max_batch_size=batch, prefix_cache_bytes=0)
    try:
        rank0.start()
        rank0.shard(loaded.model)
        executor = rank0.executor(loaded.model, lambda message: os._exit(3))
        times, tokens = _run_steps(executor, batch, loaded.config["vocab_size"], job["warmup"], job["steps"])
        executor.close()
    finally:
        rank0.close()
    return {"times": times, "tokens": tokens}


# -- mlx-lm's own shard() path (SPMD) ------------------------------------------------------------


def _mlx_lm_loop(model: Any, batch: int, vocab: int, warmup: int, steps: int) -> tuple[list[float], list]:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    x = mx.array([_prompt(vocab, b) for b in range(batch)], dtype=mx.uint32)
    y = mx.argmax(model(x, cache=cache)[:, -1, :], axis=-1)
    mx.eval(y)
    times, tokens = [], [y.tolist()]
    for i in range(warmup + steps):
        start = time.perf_counter()
        y = mx.argmax(model(y[:, None], cache=cache)[:, -1, :], axis=-1)
        mx.eval(y)
        if i >= warmup:
            times.append(time.perf_counter() - start)
        tokens.append(y.tolist())
    return times, tokens


def _leave_out_reduces(model: Any, variant: str) -> None:
    """Timing only: the attention output's all-reduce (``one-reduce``) or both (``no-reduce``) left out."""
    import mlx.nn as nn

    class LocalOnly(nn.ShardedToAllLinear):
        def __call__(self, x: Any) -> Any:
            x = x @ self["weight"].T
            return x + self["bias"] if "bias" in self else x

    for layer in model.layers:
        for parent, name in ((layer.self_attn, "o_proj"), (layer.mlp, "down_proj")):
            if name == "down_proj" and variant == "one-reduce":
                continue
            linear = getattr(parent, name)
            if type(linear) is not nn.ShardedToAllLinear:
                raise SystemExit(f"--variants {variant}: {type(linear).__name__} is not supported (float models only)")
            linear.__class__ = LocalOnly


def worker_mlx_lm(job: dict, rank: int = 0) -> dict:
    import mlx.core as mx
    from mlx_lm.utils import load

    from mlxcel.parallel.launch import GroupSpec, LocalRanks, init_group

    tp = job["tp"]
    model, _ = load(job["model"], lazy=tp > 1)
    with open(Path(job["model"]) / "config.json") as f:
        vocab = json.load(f)["vocab_size"]
    ranks = None
    if tp > 1:
        spec = GroupSpec.from_json(job["spec"])
        if rank == 0:
            ranks = LocalRanks()
            for r in range(1, tp):
                env = {"CUDA_VISIBLE_DEVICES": str(r)} if spec.backend == "nccl" else {}
                proc = subprocess.Popen([sys.executable, "-m", "bench.tp_bench", "--worker", json.dumps(job),
                                         "--worker-rank", str(r)], cwd=REPO, env={**os.environ, **env},
                                        stdout=subprocess.DEVNULL)
                ranks.procs[r] = proc
        group = init_group(spec, rank, 120.0)
        model.shard(group)
        if job["variant"] in TIMING_ONLY:
            _leave_out_reduces(model, job["variant"])
        else:
            from mlxcel.parallel.reduce import set_reduce_dtype

            set_reduce_dtype(model, job["variant"])
        mx.eval(model.parameters())
    try:
        times, tokens = _mlx_lm_loop(model, job["batch"], vocab, job["warmup"], job["steps"])
    finally:
        if ranks is not None:
            ranks.stop(30)
    return {"times": times, "tokens": tokens}


# -- the driver ------------------------------------------------------------------------------------


def run_worker(job: dict) -> dict:
    """One measurement in a fresh process; its row."""
    if job["impl"] == "mlx-lm" and job["tp"] > 1:
        from mlxcel.parallel.launch import local_group_spec

        job = {**job, "spec": local_group_spec(job["tp"], job["backend"]).to_json()}
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "bench.tp_bench", "--worker", json.dumps(job)], cwd=REPO,
                         capture_output=True, text=True, timeout=WORKER_TIMEOUT_S)
    if out.returncode != 0:
        raise RuntimeError(f"worker {job['impl']} tp {job['tp']} batch {job['batch']} failed:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    times = result["times"]
    seconds = sum(times)
    row = {k: v for k, v in job.items() if k != "spec"}
    row.update(bench="tp_bench", decode_tok_s=job["batch"] * len(times) / seconds, tokens_sha256=_digest(result["tokens"]),
               step_ms_p50=_percentile(times, 50) * 1e3, step_ms_p95=_percentile(times, 95) * 1e3,
               wall_s=time.perf_counter() - start, cpus=os.cpu_count())
    return row


def _shape(model: Path) -> dict:
    config = json.loads((model / "config.json").read_text())
    keys = ("model_type", "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
            "intermediate_size", "vocab_size")
    return {k: config.get(k) for k in keys} | {"quantized": bool(config.get("quantization"))}


def plan_jobs(args: argparse.Namespace) -> list[dict]:
    """Rounds x batches x impls, the two variants in A B B A order."""
    model = Path(args.model).resolve()
    base = {"model": str(model), "model_name": model.name, "shape": _shape(model), "backend": args.tp_backend,
            "warmup": args.warmup, "steps": args.steps,
            "invocation": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}  # groups this run's rows in reports
    a, b = args.variants
    jobs = []
    for r in range(args.rounds):
        for batch in args.batch:
            for impl in args.impl:
                for order, variant in enumerate((a, b, b, a)):
                    tp = 1 if variant == "tp1" else args.tp
                    jobs.append({**base, "impl": impl, "batch": batch, "tp": tp, "round": r, "order": order,
                                 "tp_compared": args.tp, "variant": variant,
                                 "compared": f"{a},{b}"})
    return jobs


def _label(row: dict) -> str:
    return row.get("variant") or ("tp1" if row["tp"] == 1 else "model")  # rows before --variants have none


def summarize(rows: list[dict]) -> list[str]:
    """Per model, impl and batch: each variant's median tok/s and range, B / A, and whether the tokens agree."""
    lines = []
    keys = sorted({(r["model_name"], r["impl"], r["batch"]) for r in rows})
    for name, impl, batch in keys:
        sel = [r for r in rows if (r["model_name"], r["impl"], r["batch"]) == (name, impl, batch)]
        labels = list(dict.fromkeys(_label(r) for r in sorted(sel, key=lambda r: r["order"])))
        parts, medians = [], []
        for label in labels:
            tps = [r["decode_tok_s"] for r in sel if _label(r) == label]
            medians.append(statistics.median(tps))
            tag = f"tp{sel[0]['tp_compared']} {label}" if label != "tp1" else "tp1"
            parts.append(f"{tag} {medians[-1]:8.1f} tok/s ({min(tps):.1f}-{max(tps):.1f})")
        ratio = f" | ratio {medians[-1] / medians[0]:.2f}x" if len(medians) == 2 else ""
        same = "same tokens" if len({r["tokens_sha256"] for r in sel}) == 1 else "tokens differ"
        lines.append(f"{name} {impl:6s} batch {batch}: {' | '.join(parts)}{ratio} | {same}")
    return lines


def _variants(text: str) -> list[str]:
    out = text.split(",")
    if len(out) != 2 or out[0] == out[1] or any(v not in VARIANTS for v in out):
        raise argparse.ArgumentTypeError(f"expected two different variants of {', '.join(VARIANTS)}, got {text!r}")
    return out


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench.tp_bench", description=__doc__.splitlines()[0])
    p.add_argument("-m", "--model", default="models/smollm2-135m-instruct")
    p.add_argument("--tp", type=int, default=2, help="the rank count compared with tp 1 (default 2)")
    p.add_argument("--batch", default="1,8", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--impl", default=",".join(IMPLS), type=lambda s: s.split(","))
    p.add_argument("--tp-backend", default="ring", choices=("ring", "nccl", "jaccl"))
    p.add_argument("--variants", default="tp1,model", type=_variants,
                   help=f"the two configurations compared A B B A (default tp1,model): {', '.join(VARIANTS)}")
    p.add_argument("--rounds", type=int, default=1, help="A B B A rounds (default 1)")
    p.add_argument("--warmup", type=int, default=3, help="decode steps before timing (default 3)")
    p.add_argument("--steps", type=int, default=16, help="timed decode steps per run (default 16)")
    p.add_argument("--out", default=None, help="append rows to this JSONL (with the environment)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-rank", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker is None and (args.tp < 2 or any(i not in IMPLS for i in args.impl)):
        p.error(f"--tp must be 2 or more and --impl a list of {', '.join(IMPLS)}")
    if args.worker is None and "mlxcel" in args.impl and any(v in TIMING_ONLY for v in args.variants):
        p.error(f"--variants {', '.join(TIMING_ONLY)} run mlx-lm's loop only: add --impl mlx-lm")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.worker is not None:
        import mlxcel  # noqa: F401 - OpenBLAS before MLX (mlxcel/blas.py)

        job = json.loads(args.worker)
        out = worker_mlx_lm(job, args.worker_rank) if job["impl"] == "mlx-lm" else worker_mlxcel(job)
        if args.worker_rank == 0:
            print(json.dumps(out), flush=True)
        sys.stdout.flush()
        os._exit(0)  # MLX's static destructors after threads (see mlxcel.process.exit_process)
    rows = []
    for job in plan_jobs(args):
        row = run_worker(job)
        rows.append(row)
        print(f"round {row['round']} {row['impl']:6s} batch {row['batch']} tp {row['tp']} {_label(row)}: "
              f"{row['decode_tok_s']:.1f} tok/s (step p50 {row['step_ms_p50']:.1f} ms)", file=sys.stderr, flush=True)
        if args.out:
            from bench.environment import write_jsonl

            write_jsonl(args.out, [row])
    for line in summarize(rows):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
