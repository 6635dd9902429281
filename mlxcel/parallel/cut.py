"""The one way a model is cut for tensor parallelism: its family's row (``mlxcel.parallel.families``).

``shard`` "mlx-lm" runs the class's own ``Model.shard(group)``; "mlxcel" runs
``mlxcel.parallel.megatron.shard``; "rule" runs ``mlxcel.parallel.rule.shard`` (a family without a row). Around it: an LM head that mlx-lm splits by vocabulary is put
back whole (``--tp-lm-head-mode replicated``, the only mode), and under ``--tp-moe-mode
expert_parallel`` the routed experts are placed whole, E/N per rank (``mlxcel.parallel.experts``).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlxcel.parallel import experts as ep
from mlxcel.parallel import megatron, rule
from mlxcel.parallel.errors import ShardRefusal
from mlxcel.parallel.families import TPFamily


def _path(model: Any, path: str) -> Any:
    for name in path.split("."):
        model = getattr(model, name)
    return model


def cut(model: Any, family: TPFamily, moe_mode: str | None, group: Any) -> None:
    """Shard ``model`` in place over ``group``."""
    if moe_mode is not None and family.experts is None:
        raise ShardRefusal(f"--tp-moe-mode {moe_mode}: this family has no routed experts")
    whole = ep.saved(model, family.experts) if moe_mode == "expert_parallel" and family.shard == "mlx-lm" else None
    head = None
    if family.head is not None:
        parent = _path(model, family.head[0])
        head = (parent, getattr(parent, family.head[1], None))
    if family.shard == "mlx-lm":
        model.shard(group)
    elif family.shard == "rule":
        rule.shard(model, group, moe_mode)
    else:
        megatron.shard(model, group, family.experts if moe_mode else None, moe_mode == "within_expert")
    if head is not None and head[1] is not None:
        setattr(head[0], family.head[1], head[1])  # type: ignore[index]
        head[0].sharding_group = None
    if moe_mode == "expert_parallel":
        assert family.experts is not None
        ep.place(model, family.experts, group.rank(), group.size(), whole)
    if moe_mode is not None and family.shard in ("mlxcel", "rule"):
        assert family.experts is not None
        megatron.reduce_experts(model, family.experts, group)
    mx.eval(private_arrays(model))


def private_arrays(model: Any) -> list[mx.array]:
    """Arrays modules keep outside their parameters (hunyuan's rope ``_freqs``): evaluated here, on the
    thread that loads, for the step thread that later reads them has none of this thread's streams."""
    return [v for _, m in model.named_modules() for k, v in m.items() if k.startswith("_") and isinstance(v, mx.array)]
