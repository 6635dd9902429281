"""mlxcel's own shard plan, for the families whose mlx-lm class has no ``shard()``.

gemma3_text, gemma4_text, ernie4_5 and hunyuan_v1_dense name their layers as llama does, so one
plan, the one mlx-lm's llama ``shard()`` applies, cuts them all: in every decoder layer
``self_attn.{q,k,v}_proj`` keep 1/N of their output rows and ``o_proj`` 1/N of its input columns
(an all-reduce after it), ``n_heads``/``n_kv_heads`` become the per-rank counts, and likewise
``mlp.{gate,up}_proj`` / ``mlp.down_proj``. A projection a layer lacks is skipped (gemma4's
KV-shared layers have no k/v; its k = v layers no v). Norms over one head (q_norm, k_norm) need no
change; the per-layer-input gate of gemma4 acts on the whole hidden state and stays replicated.
A MoE block beside the MLP (gemma4's ``experts``) has no all-reduce of its own: ``Reduced`` adds
one after it, and ``--tp-moe-mode within_expert`` splits every expert's width here (whole experts
are placed by ``mlxcel.parallel.experts``).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import shard_inplace, shard_linear

from mlxcel.parallel.families import Experts

ATTENTION = ("self_attn", ("q_proj", "k_proj", "v_proj"), "o_proj", ("n_heads", "n_kv_heads"))
MLP = ("mlp", ("gate_proj", "up_proj"), "down_proj", ())


class Reduced(nn.Module):
    """A block whose output is one rank's partial sum: all-reduce it (gemma4's experts)."""

    def __init__(self, inner: nn.Module, group: Any):
        super().__init__()
        self.inner = inner
        self.group = group

    def __call__(self, *args: Any, **kwargs: Any) -> mx.array:
        return mx.distributed.all_sum(self.inner(*args, **kwargs), group=self.group)


def _shard_block(block: Any, inputs: tuple[str, ...], output: str, counts: tuple[str, ...], group: Any) -> None:
    n = group.size()
    for name in inputs:
        if isinstance(getattr(block, name, None), nn.Module):
            setattr(block, name, shard_linear(getattr(block, name), "all-to-sharded", group=group))
    setattr(block, output, shard_linear(getattr(block, output), "sharded-to-all", group=group))
    for name in counts:
        setattr(block, name, getattr(block, name) // n)


def shard(model: Any, group: Any, experts: Experts | None, within_expert: bool) -> None:
    """Cut every decoder layer of ``model`` in place over ``group`` (``within_expert``: the experts' width too)."""
    for layer in model.layers:
        for attr, inputs, output, counts in (ATTENTION, MLP):
            _shard_block(getattr(layer, attr), inputs, output, counts, group)
        block = getattr(layer, experts.block, None) if experts is not None and within_expert else None
        if block is not None:
            switch = getattr(block, experts.switch)
            for name, how in (("gate_proj", "all-to-sharded"), ("up_proj", "all-to-sharded"),
                              ("down_proj", "sharded-to-all")):
                shard_inplace(getattr(switch, name), how, group=group)


def reduce_experts(model: Any, experts: Experts, group: Any) -> None:
    """All-reduce the output of every MoE block (once its experts are split, by either mode)."""
    for layer in model.layers:
        block = getattr(layer, experts.block, None)
        if block is not None:
            setattr(layer, experts.block, Reduced(block, group))
