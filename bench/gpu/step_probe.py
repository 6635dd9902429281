"""Where one evaluation of a stage's decode step goes: graph construction against the device and sync.

Times --steps decode steps (one row, each evaluated, as a stage does) of the first half of the
model and of the whole model, in variants that isolate the candidates for the compiled step's
slowness on the GPU (docs/benchmarks.md, H200 2026-12-02):

- ``plain``: mlx-lm's KVCache (sliced keys, no mask at decode), the stage's path today;
- ``plain_mask``: the same with an explicit all-true boolean mask (what the compiled step passes);
- ``compiled``: ``CompiledDecode`` (whole buffer, boolean mask, offset array);
- ``compiled_nomask``: the compiled step without the mask (attends the unused zeros too: wrong
  numbers, for timing only).

Per variant: ``build_ms`` (the forward call, which only builds the lazy graph, or replays a compiled
one) and ``step_ms`` (build + evaluation + wait), medians. Rows: --out (JSONL with the environment).

    python -m bench.gpu.step_probe -m /tmp/models/q06-bf16 --steps 64 --out bench/results/step_probe.jsonl
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from bench.environment import write_jsonl


def _variant_cache(name: str, make_cache: Any) -> list:
    from mlx_lm.models.cache import KVCache

    import mlx.core as mx

    class MaskedKVCache(KVCache):
        def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> Any:
            return mx.ones((n, self.offset + n), dtype=mx.bool_)

    cache = make_cache()
    if name == "plain_mask":
        cache = [MaskedKVCache() for _ in cache]
    return cache


def time_variant(model: Any, end: int, name: str, steps: int, prompt: int) -> tuple[list[float], list[float]]:
    import mlx.core as mx

    from mlxcel.engine import compiled_step
    from mlxcel.engine.compiled_step import CompiledDecode
    from mlxcel.engine.model_slice import ModelSlice

    piece = ModelSlice(model, 0, end)
    plain = lambda x, c: piece(x, c)  # noqa: E731
    forward: Any = plain
    saved = compiled_step._FixedView.make_mask
    if name.startswith("compiled"):
        forward = CompiledDecode(plain)
    if name == "compiled_nomask":
        compiled_step._FixedView.make_mask = lambda self, n, return_array=False, window_size=None: None
    try:
        cache = _variant_cache(name, piece.make_cache)
        mx.eval(forward(mx.random.randint(0, 256, (1, prompt)).astype(mx.int32), cache))
        builds, totals = [], []
        for i in range(steps + 8):
            x = mx.random.randint(0, 256, (1, 1)).astype(mx.int32)
            mx.eval(x)
            t0 = time.perf_counter()
            out = forward(x, cache)
            t1 = time.perf_counter()
            mx.eval(out)
            t2 = time.perf_counter()
            if i >= 8:
                builds.append(t1 - t0)
                totals.append(t2 - t0)
    finally:
        compiled_step._FixedView.make_mask = saved
    return builds, totals


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", required=True)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--prompt", type=int, default=100)
    p.add_argument("--rounds", type=int, default=2, help="passes over the variants, order reversed every other")
    p.add_argument("--out", type=Path, default=Path("bench/results/step_probe.jsonl"))
    p.add_argument("--label", default=None)
    args = p.parse_args(argv)

    import mlxcel  # noqa: F401
    from mlxcel.models.loading import load_checkpoint

    model = load_checkpoint(args.model).model
    n = len(model.model.layers)
    variants = ["plain", "plain_mask", "compiled", "compiled_nomask"]
    rows = []
    for rnd in range(args.rounds):
        for end in (n // 2, n):
            for name in (variants if rnd % 2 == 0 else variants[::-1]):
                builds, totals = time_variant(model, end, name, args.steps, args.prompt)
                row = {"bench": "step_probe", "model": Path(args.model).name, "label": args.label, "round": rnd,
                       "layers": [0, end], "variant": name, "steps": args.steps,
                       "build_ms_p50": round(statistics.median(builds) * 1e3, 4),
                       "step_ms_p50": round(statistics.median(totals) * 1e3, 4)}
                rows.append(row)
                print(f"round {rnd} layers 0-{end - 1} {name:>16}: build {row['build_ms_p50']:.2f} ms, "
                      f"step {row['step_ms_p50']:.2f} ms", flush=True)
    write_jsonl(args.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
