"""What a pipeline stage of a mixture-of-experts model spends on routing and on its experts.

For each half of the model (the slices a 2-stage pipeline runs) it times --steps decode steps
(one row, evaluated each step, as a stage does) in three variants and takes differences:

- ``full``: the model as it is;
- ``fixed_routing``: every MoE block skips its router (gate projection, softmax, top-k, scores)
  and sends the token to the same k experts with equal weights: full - this = the routing;
- ``no_moe``: every MoE block returns zeros (router and experts skipped; deepseek's shared
  expert too): fixed_routing - this = the experts (the gathered quantized matmuls and the
  weighted sum), and this alone = attention, norms and the dense layers.

Each variant runs plain (the compiled variant went with the compiled step, issue 41). Rows: --out (JSONL, with the
environment). qwen3_moe and deepseek_v3 checkpoints (their MoE classes are patched by name).

    python -m bench.gpu.moe_probe -m /tmp/moe30b-q4 --steps 64 --out bench/results/moe_probe.jsonl
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from bench.environment import write_jsonl


def _fixed(k: int, n: int, shape: tuple[int, ...]) -> tuple[Any, Any]:
    import mlx.core as mx

    inds = mx.broadcast_to(mx.arange(0, n, max(n // k, 1))[:k].astype(mx.uint32), (*shape, k))
    return inds, mx.full((*shape, k), 1.0 / k)


@contextmanager
def variant(model: Any, name: str) -> Iterator[None]:
    """Patch the model family's MoE classes for ``name`` (full, fixed_routing, no_moe) while inside."""
    import mlx.core as mx

    family = type(model).__module__.rsplit(".", 1)[-1]
    patches: list[tuple[type, str, Any]] = []
    if family == "qwen3_moe":
        from mlx_lm.models.qwen3_moe import Qwen3MoeSparseMoeBlock as Block

        def fixed_call(self: Any, x: Any) -> Any:
            inds, scores = _fixed(self.top_k, self.num_experts, x.shape[:-1])
            y = self.switch_mlp(x, inds)
            return (y * scores.astype(y.dtype)[..., None]).sum(axis=-2).astype(y.dtype)

        if name == "fixed_routing":
            patches.append((Block, "__call__", fixed_call))
    elif family == "deepseek_v3":
        from mlx_lm.models.deepseek_v3 import DeepseekV3MoE as Block, MoEGate

        def fixed_gate(self: Any, x: Any) -> Any:
            return _fixed(self.top_k, self.n_routed_experts, x.shape[:-1])

        if name == "fixed_routing":
            patches.append((MoEGate, "__call__", fixed_gate))
    else:
        raise SystemExit(f"moe_probe knows qwen3_moe and deepseek_v3, not {family}")
    if name == "no_moe":
        patches.append((Block, "__call__", lambda self, x: mx.zeros_like(x)))
    saved = [(cls, attr, getattr(cls, attr)) for cls, attr, _ in patches]
    for cls, attr, fn in patches:
        setattr(cls, attr, fn)
    try:
        yield
    finally:
        for cls, attr, fn in saved:
            setattr(cls, attr, fn)


def time_slice(model: Any, start: int, end: int, steps: int, prompt: int) -> list[float]:
    """Seconds per decode step of layers [start, end) (each step evaluated), after a short warm-up."""
    import mlx.core as mx

    from mlxcel.engine.model_slice import ModelSlice

    piece = ModelSlice(model, start, end)
    forward = piece
    cache = piece.make_cache()
    dtype = model.model.embed_tokens.scales.dtype if hasattr(model.model.embed_tokens, "scales") \
        else model.model.embed_tokens.weight.dtype
    width = model.args.hidden_size

    def inputs(n: int) -> Any:
        if piece.is_first:
            return mx.random.randint(0, 256, (1, n)).astype(mx.int32)
        return (mx.random.normal((1, n, width)) * 0.1).astype(dtype)

    mx.eval(forward(inputs(prompt), cache))
    out: list[float] = []
    for i in range(steps + 8):
        x = inputs(1)
        mx.eval(x)
        t0 = time.perf_counter()
        mx.eval(forward(x, cache))
        if i >= 8:
            out.append(time.perf_counter() - t0)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", required=True)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--prompt", type=int, default=64, help="positions in each cache before the timed steps")
    p.add_argument("--out", type=Path, default=Path("bench/results/moe_probe.jsonl"))
    p.add_argument("--label", default=None)
    args = p.parse_args(argv)

    import mlxcel  # noqa: F401
    from mlxcel.models.loading import load_checkpoint

    model = load_checkpoint(args.model).model
    n = len(model.model.layers)
    rows = []
    for start, end in ((0, n // 2), (n // 2, n)):
        for compiled in (False,):  # the compiled variant went with the compiled step (issue 41)
            ms = {}
            for name in ("full", "fixed_routing", "no_moe"):
                with variant(model, name):
                    ms[name] = statistics.median(time_slice(model, start, end, args.steps, args.prompt)) * 1e3
            full = ms["full"]
            row = {"bench": "moe_probe", "model": Path(args.model).name, "label": args.label, "layers": [start, end],
                   "compiled": compiled, "steps": args.steps, **{f"{k}_ms_p50": round(v, 4) for k, v in ms.items()},
                   "routing_ms": round(full - ms["fixed_routing"], 4),
                   "experts_ms": round(ms["fixed_routing"] - ms["no_moe"], 4),
                   "routing_fraction": round((full - ms["fixed_routing"]) / full, 4),
                   "experts_fraction": round((ms["fixed_routing"] - ms["no_moe"]) / full, 4)}
            rows.append(row)
            print(f"layers {start}-{end - 1} {'compiled' if compiled else 'plain   '}: full {full:.2f} ms, "
                  f"fixed routing {ms['fixed_routing']:.2f}, no MoE {ms['no_moe']:.2f} -> routing "
                  f"{row['routing_fraction']:.0%}, experts {row['experts_fraction']:.0%} of the step", flush=True)
    write_jsonl(args.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
