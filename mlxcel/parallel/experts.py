"""``--tp-moe-mode expert_parallel``: each rank keeps E/N whole routed experts.

The router stays replicated, so every rank picks the same k experts for every token. Rank r keeps
experts [r E/N, (r+1) E/N) (``LocalExperts``): a token's picks that another rank holds give zero
here, so the MoE block's weighted sum over the k picks is this rank's share, and the block's own
all-reduce (mlx-lm's ``sharding_group``, or ``megatron.Reduced``) adds the shares of all ranks.
Each rank holds 1/N of the expert weights; it still runs k expert products per token (the picks it
does not hold are computed on a stand-in expert and masked), so the mode saves memory, not FLOPs.

With mlx-lm's ``shard()`` (which splits every expert's width, ``within_expert``), ``saved`` keeps
the routed experts' whole parameters before it runs and ``place`` puts them back before keeping
this rank's experts; everything else (attention, dense and shared MLPs) is as ``shard()`` cut it.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map

from mlxcel.parallel.errors import ShardRefusal
from mlxcel.parallel.families import Experts


class LocalExperts(nn.Module):
    """Experts [start, start + count) of a SwitchGLU; the other experts' outputs are zero."""

    def __init__(self, inner: nn.Module, start: int, count: int):
        super().__init__()
        self.inner = inner
        self.start = start
        self.count = count

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        local = indices - self.start
        mine = (local >= 0) & (local < self.count)
        y = self.inner(x, mx.where(mine, local, 0))
        return y * mine[..., None].astype(y.dtype)


def moe_switches(model: Any, experts: Experts) -> list[tuple[Any, nn.Module]]:
    """(block, routed experts) of every MoE layer, in layer order (dense layers have none)."""
    found = []
    for layer in model.layers:
        block = layer
        for name in experts.block.split("."):  # "mlp.experts": deepseek_v41 nests its routed experts
            block = getattr(block, name, None)
        switch = getattr(block, experts.switch, None) if block is not None else None
        if isinstance(switch, nn.Module):
            found.append((block, switch))
    return found


def saved(model: Any, experts: Experts) -> list[dict]:
    """The routed experts' parameters as loaded (lazy arrays: nothing is copied)."""
    return [switch.parameters() for _, switch in moe_switches(model, experts)]


def _keep(total: int, start: int, count: int):
    def take(p: mx.array) -> mx.array:  # contiguous, as MLX's own shard: a slice's view would keep every expert
        if isinstance(p, mx.array) and p.ndim and p.shape[0] == total:
            return mx.contiguous(p[start:start + count])
        return p
    return take


def place(model: Any, experts: Experts, rank: int, size: int, whole: list[dict] | None = None) -> int:
    """Keep this rank's experts in every MoE layer (``whole``: the parameters to start from); returns the count."""
    switches = moe_switches(model, experts)
    if whole is not None and len(whole) != len(switches):
        raise ShardRefusal(f"{len(switches)} MoE layers after sharding, {len(whole)} before")
    for i, (block, switch) in enumerate(switches):
        if whole is not None:
            switch.update(whole[i])
        total = int(switch.gate_proj["weight"].shape[0])
        if total % size:
            raise ShardRefusal(f"a MoE layer has {total} routed experts, not divisible by {size} ranks")
        count = total // size
        switch.update(tree_map(_keep(total, rank * count, count), switch.parameters()))
        setattr(block, experts.switch, LocalExperts(switch, rank * count, count))
    return len(switches)
