"""What a prompt chunk and a batched decode step cost the host, by shape: first use against repeats.

The H200 profile of the server at 32 streams put about a quarter of the scheduler thread in queueing
prompt chunks (``mx.async_eval`` of an intermediate chunk, about 27 ms of a mixed pass), against about
11 ms for a whole 32-row decode step. This probe tells whether a chunk is dear by itself or only the
first time its shape is seen (kernels built per shape):

- ``chunk``: an intermediate prompt chunk of each length in --lengths, each on a fresh cache, in
  order (every length first seen, then repeated by the next round);
- ``decode``: one decode step of --rows rows over a batched cache of --context positions, --steps times;
- ``after_leave`` / ``after_join``: then, in turn, one row leaves the batch (``batch_rows.filter_rows``)
  or a fresh row joins it (``merge`` + ``extend``, as the runner does), each followed by three decode steps:
  what a change of the batch costs the step that carries it, against the steady ``decode`` steps
  (``PROBE_JOINS`` rounds, default 4; ``PROBE_JOIN_SAME=1``: every joining row of the same length). The
  shape-stable join (``batch_rows.append_rows``) this probe also measured was removed with
  ``MLXCEL_STABLE_JOIN`` (issue 41); ``PROBE_JOIN_MLX_LM`` is no longer read.

Per call: ``queue_ms`` (building the graph and ``mx.async_eval``, the scheduler thread's share) and
``total_ms`` (to the end of the evaluation). Rows: --out (JSONL with the environment).

    python -m bench.gpu.prefill_probe -m /tmp/models/q06-bf16 --out bench/results/prefill_probe.jsonl
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

from bench.environment import write_jsonl


def timed(run: Any) -> tuple[float, float]:
    """(queue_ms, total_ms) of ``run()``, which builds a graph and returns the arrays to evaluate."""
    import mlx.core as mx

    start = time.perf_counter()
    arrays = run()
    mx.async_eval(arrays)
    queued = time.perf_counter()
    mx.eval(arrays)
    end = time.perf_counter()
    return round((queued - start) * 1000, 3), round((end - start) * 1000, 3)


def chunk_rows(model: Any, lengths: list[int], rounds: int, label: str) -> list[dict]:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    rows = []
    for rnd in range(rounds):
        for n in lengths:
            cache = make_prompt_cache(model)
            tokens = mx.array([[(7 * i) % 250 + 3 for i in range(n)]], dtype=mx.uint32)
            queue_ms, total_ms = timed(lambda: [model(tokens, cache=cache)] and [c.state for c in cache])
            rows.append({"bench": "prefill_probe", "label": label, "kind": "chunk", "round": rnd, "tokens": n,
                         "queue_ms": queue_ms, "total_ms": total_ms})
    return rows


def decode_rows(model: Any, rows_n: int, context: int, steps: int, label: str) -> list[dict]:
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    singles = []
    for r in range(rows_n):
        cache = make_prompt_cache(model)
        n = context - r % 7  # rows of slightly different lengths, as in a server
        model(mx.array([[3] * n], dtype=mx.uint32), cache=cache)
        mx.eval([c.state for c in cache])
        singles.append(cache)
    from mlxcel.engine.batch_rows import extended_pads, filter_rows, merged_pads

    layers = range(len(singles[0]))
    batched = [KVCache.merge([s[layer] for s in singles]) for layer in layers]
    pads = [merged_pads([s[layer] for s in singles]) for layer in layers]
    out = []

    def step(kind: str, k: int) -> None:
        n = batched[0].offset.shape[0]
        tokens = mx.array([[5]] * n, dtype=mx.uint32)
        queue_ms, total_ms = timed(lambda: [mx.argmax(model(tokens, cache=batched)[:, -1, :], axis=-1)])
        out.append({"bench": "prefill_probe", "label": label, "kind": kind, "round": k, "rows": n,
                    "context": context, "queue_ms": queue_ms, "total_ms": total_ms})

    for k in range(steps):
        step("decode", k)
    same = os.environ.get("PROBE_JOIN_SAME") == "1"  # every joining row of one length (kernels per shape?)
    for k in range(int(os.environ.get("PROBE_JOINS", "4"))):  # a row leaves, three steps; a row joins, three
        keep = list(range(1, batched[0].offset.shape[0]))
        pads = [filter_rows(c, keep, p) for c, p in zip(batched, pads)]
        for j in range(3):
            step("after_leave", 3 * k + j)
        fresh = make_prompt_cache(model)
        model(mx.array([[4] * (context // 2 + (0 if same else k))], dtype=mx.uint32), cache=fresh)
        joining = [KVCache.merge([c]) for c in fresh]  # mlx-lm's merge and extend, as the runner joins
        pads = [extended_pads(c, p, m, merged_pads([f])) for c, p, m, f in zip(batched, pads, joining, fresh)]
        for c, m in zip(batched, joining):
            c.extend(m)
        for j in range(3):
            step("after_join", 3 * k + j)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="prefill_probe", description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", required=True)
    p.add_argument("--lengths", default="97,98,99,100,113,128,160,200", help="chunk lengths (comma)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--context", type=int, default=200)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--label", default="")
    p.add_argument("--out", type=Path, default=Path("bench/results/prefill_probe.jsonl"))
    args = p.parse_args(argv)
    from mlx_lm.generate import generation_stream

    import mlx.core as mx
    from mlxcel.models.loading import load_checkpoint

    model = load_checkpoint(Path(args.model)).model
    with mx.stream(generation_stream):
        rows = chunk_rows(model, [int(x) for x in args.lengths.split(",")], args.rounds, args.label)
        rows += decode_rows(model, args.rows, args.context, args.steps, args.label)
    for r in rows:
        print("prefill_probe:", r, flush=True)
    write_jsonl(args.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
