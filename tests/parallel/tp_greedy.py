"""Many checkpoints' tensor-parallel greedy tokens from one group of rank processes (test_tp_families.py).

``python -m tests.parallel.tp_greedy JOBS OUT``, one process per rank under ``MLX_RANK`` / ``MLX_HOSTFILE``
(the ring on loopback): the group is joined once, then for every job of JOBS (a JSON list of ``[model dir,
--tp-moe-mode or null]``) the checkpoint is loaded, cut by ``apply_plan`` with the default reduce dtype
(as a follower cuts it, ``mlxcel/parallel/follower.py``) and ``N`` greedy tokens of ``PROMPT`` generated.
Both ranks run the jobs in the same order, so their collectives pair up; rank 0 writes one
``{"plan": ShardPlan.describe(), "tokens": [...]}`` per job to OUT (JSON). ``greedy(model_dir)`` in the
test's own process is the whole model's (tp 1's) reference.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

PROMPT = [1, 7, 3, 12, 40]
N = 6  # tokens


def greedy(model: Any) -> list[int]:
    """``N`` greedy token ids of ``PROMPT`` (no EOS stop) from ``model`` (a directory: its whole model)."""
    from mlxcel.engine.generate import generate_tokens, make_cache
    from mlxcel.engine.sampling import SamplingParams, make_sampler

    if isinstance(model, (str, Path)):
        from mlxcel.models.loading import load_checkpoint

        model = load_checkpoint(Path(model), tokenizer=False).model
    cache = make_cache(model)
    sampler = make_sampler(SamplingParams())
    return [t for t, _ in generate_tokens(lambda x, c: model(x, cache=c), PROMPT, cache, sampler, N)]


def sharded(model_dir: Path, mode: str | None, group: Any) -> dict:
    """The plan line and greedy tokens of ``model_dir`` cut over ``group`` as a follower cuts it."""
    import mlx.core as mx

    from mlxcel.config import DEFAULT_TP_REDUCE_DTYPE
    from mlxcel.models.loading import load_checkpoint
    from mlxcel.parallel.plan import apply_plan, check_shardable
    from mlxcel.parallel.reduce import set_reduce_dtype

    loaded = load_checkpoint(model_dir, lazy=True, tokenizer=False)
    plan = check_shardable(loaded.config, group.size(), model_dir, moe_mode=mode)
    apply_plan(loaded.model, plan, group)
    set_reduce_dtype(loaded.model, DEFAULT_TP_REDUCE_DTYPE)
    mx.eval(loaded.model.parameters())
    return {"plan": plan.describe(), "tokens": greedy(loaded.model)}


def run_group(jobs: list[tuple[Path, str | None]], out: Path, size: int = 2, timeout: float = 400) -> list[dict]:
    """Every job's plan line and tokens, from ``size`` rank processes of this module joined by the ring on
    127.0.0.1 (one process per rank for all the jobs)."""
    from tests.parallel.ring_ranks import run_ranks

    jobs_file, result = out / "jobs.json", out / "tokens.json"
    jobs_file.write_text(json.dumps([[str(path), mode] for path, mode in jobs]))
    run_ranks("tests.parallel.tp_greedy", [str(jobs_file), str(result)], out, size, timeout)
    return json.loads(result.read_text())


def main(jobs_file: Path, out: Path) -> None:
    import mlx.core as mx

    group = mx.distributed.init(backend="ring", strict=True)
    rows = [sharded(Path(path), mode, group) for path, mode in json.loads(jobs_file.read_text())]
    if group.rank() == 0:
        out.write_text(json.dumps(rows))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
