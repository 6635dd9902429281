"""One rank of a tensor-parallel logits check: ``python -m tests.parallel.tp_logits MODEL OUT [MOE_MODE]``,
or ``python -m tests.parallel.tp_logits --jobs JOBS OUTDIR`` for many checkpoints in one group.

Under ``MLX_RANK`` / ``MLX_HOSTFILE`` (the ring on loopback) the model is cut by ``apply_plan`` as a
follower cuts it; without them it runs whole. Either way it writes the float32 logits of a 4-token
prefill and 2 decode steps to OUT (``.npy``). With ``--jobs`` (a JSON list of ``[model dir, moe mode or
null]``) the group is joined once and job ``i``'s logits go to ``OUTDIR/rank{rank}-{i}.npy``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

PROMPT = [1, 7, 3, 12]
STEPS = [5, 9]


def logits(model_dir: Path, moe_mode: str | None = None, group=None) -> np.ndarray:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from mlxcel.models.loading import load_checkpoint
    from mlxcel.parallel.plan import apply_plan, check_shardable

    loaded = load_checkpoint(model_dir, tokenizer=False)
    model = loaded.model
    model.set_dtype(mx.float32)
    if "MLX_RANK" in os.environ:
        group = group or mx.distributed.init(backend="ring", strict=True)
        apply_plan(model, check_shardable(loaded.config, group.size(), model_dir, moe_mode=moe_mode), group)
    cache = make_prompt_cache(model)
    rows = [model(mx.array([PROMPT]), cache=cache)[0]]
    rows += [model(mx.array([[t]]), cache=cache)[0] for t in STEPS]
    out = mx.concatenate(rows, axis=0).astype(mx.float32)
    mx.eval(out)
    return np.array(out)


def jobs(jobs_file: Path, out: Path) -> None:
    """Every job's logits from one group, joined once (both ranks run the jobs in the same order)."""
    import json

    import mlx.core as mx

    group = mx.distributed.init(backend="ring", strict=True)
    for i, (model, mode) in enumerate(json.loads(jobs_file.read_text())):
        np.save(out / f"rank{group.rank()}-{i}.npy", logits(Path(model), mode, group))


if __name__ == "__main__":
    if sys.argv[1] == "--jobs":
        jobs(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        model, out, *mode = sys.argv[1:]
        np.save(out, logits(Path(model), mode[0] if mode else None))
