"""One rank of a tensor-parallel logits check: ``python -m tests.parallel.tp_logits MODEL OUT [MOE_MODE]``.

Under ``MLX_RANK`` / ``MLX_HOSTFILE`` (the ring on loopback) the model is cut by ``apply_plan`` as a
follower cuts it; without them it runs whole. Either way it writes the float32 logits of a 4-token
prefill and 2 decode steps to OUT (``.npy``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

PROMPT = [1, 7, 3, 12]
STEPS = [5, 9]


def logits(model_dir: Path, moe_mode: str | None = None) -> np.ndarray:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from mlxcel.models.loading import load_checkpoint
    from mlxcel.parallel.plan import apply_plan, check_shardable

    loaded = load_checkpoint(model_dir, tokenizer=False)
    model = loaded.model
    model.set_dtype(mx.float32)
    if "MLX_RANK" in os.environ:
        group = mx.distributed.init(backend="ring", strict=True)
        apply_plan(model, check_shardable(loaded.config, group.size(), model_dir, moe_mode=moe_mode), group)
    cache = make_prompt_cache(model)
    rows = [model(mx.array([PROMPT]), cache=cache)[0]]
    rows += [model(mx.array([[t]]), cache=cache)[0] for t in STEPS]
    out = mx.concatenate(rows, axis=0).astype(mx.float32)
    mx.eval(out)
    return np.array(out)


if __name__ == "__main__":
    model, out, *mode = sys.argv[1:]
    np.save(out, logits(Path(model), mode[0] if mode else None))
