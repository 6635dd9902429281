"""Which checkpoints shard over N ranks, decided from config.json alone (before any weight is read).

A dense layer shards by attention heads and MLP width (Megatron-style, mlx-lm's ``Model.shard``):
q/k/v and gate/up keep 1/N of their output rows (``all-to-sharded``), o_proj and down_proj 1/N of
their input columns and all-reduce their output (``sharded-to-all``). So N must divide the attention
heads, the KV heads and the intermediate size, and, for a quantized checkpoint, each rank's share of
the two reduced inputs must be whole quantization groups. Embedding and LM head stay replicated.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import gcd
from pathlib import Path
from typing import Any, Mapping

from mlxcel.parallel.errors import ShardRefusal

#: model_type -> what it covers; every entry's mlx-lm class has ``shard(group)``
FAMILIES: dict[str, str] = {
    "llama": "Llama 2/3, SmolLM2",
    "mistral": "Mistral, as llama",
    "qwen2": "Qwen 2/2.5",
    "qwen3": "Qwen 3",
}
FAMILIES_HELP = "dense text families " + ", ".join(f"{k} ({v})" for k, v in FAMILIES.items())
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")


@dataclass(frozen=True)
class ShardPlan:
    """How one checkpoint splits over ``size`` ranks (per rank)."""

    family: str
    size: int
    heads: int
    kv_heads: int
    intermediate: int

    def describe(self) -> str:
        return (f"{self.family} over {self.size} ranks: {self.heads // self.size} of {self.heads} heads, "
                f"{self.kv_heads // self.size} of {self.kv_heads} KV heads, "
                f"{self.intermediate // self.size} of {self.intermediate} MLP columns per rank")


def _int(config: Mapping[str, Any], key: str, where: str) -> int:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ShardRefusal(f"{where}: config.json has no positive integer {key}, so it cannot be sharded")
    return value


def working_sizes(*dims: int) -> list[int]:
    """Every rank count that divides all ``dims``."""
    g = 0
    for d in dims:
        g = gcd(g, d)
    return [n for n in range(1, g + 1) if g % n == 0]


def _check_family(config: Mapping[str, Any], where: str) -> str:
    family = str(config.get("model_type"))
    if family in FAMILIES:
        return family
    if any(key in config for key in _MOE_KEYS):
        raise ShardRefusal(f"{where}: {family} is a mixture-of-experts family; tensor parallelism supports "
                           f"{', '.join(FAMILIES)} only (--tp-moe-mode is kept for when MoE families are added)")
    raise ShardRefusal(f"{where}: model family {family!r} is not supported by tensor parallelism; "
                       f"supported: {', '.join(FAMILIES)}")


def _check_quantized(config: Mapping[str, Any], size: int, q_width: int, intermediate: int, where: str) -> None:
    quant = config.get("quantization") or config.get("quantization_config")
    if not isinstance(quant, Mapping):
        return
    group = quant.get("group_size")
    if not isinstance(group, int) or group <= 0:
        return
    for name, width in (("attention output width (heads x head_dim)", q_width), ("intermediate size", intermediate)):
        if (width // size) % group:
            raise ShardRefusal(f"{where} does not shard across {size} ranks: each rank's share of the {name} "
                               f"({width} / {size} = {width // size}) is not a whole number of quantization "
                               f"groups of {group}")


def check_shardable(config: Mapping[str, Any], size: int, where: str | Path = "the model") -> ShardPlan:
    """The plan for ``size`` ranks, or ``ShardRefusal`` naming the dimension that does not divide."""
    where = str(where)
    family = _check_family(config, where)
    heads = _int(config, "num_attention_heads", where)
    kv_heads = config.get("num_key_value_heads") or heads
    if isinstance(kv_heads, bool) or not isinstance(kv_heads, int) or kv_heads <= 0:
        raise ShardRefusal(f"{where}: config.json's num_key_value_heads must be a positive integer")
    intermediate = _int(config, "intermediate_size", where)
    hidden = _int(config, "hidden_size", where)
    head_dim = config.get("head_dim") or hidden // heads
    dims = (("attention heads", heads), ("KV heads", kv_heads), ("intermediate size", intermediate))
    for name, value in dims:
        if value % size:
            works = ", ".join(str(n) for n in working_sizes(heads, kv_heads, intermediate))
            raise ShardRefusal(f"{where} does not shard across {size} ranks: {name} ({value}) is not divisible by "
                               f"{size} (this model has {heads} attention heads, {kv_heads} KV heads, intermediate "
                               f"size {intermediate}; --tp-size values that work: {works})")
    _check_quantized(config, size, heads * int(head_dim), intermediate, where)
    return ShardPlan(family, size, heads, kv_heads, intermediate)


def apply_plan(model: Any, plan: ShardPlan, group: Any) -> None:
    """Shard ``model`` in place over ``group`` with mlx-lm's own ``shard`` and check the result."""
    if group.size() != plan.size:
        raise ShardRefusal(f"the distributed group has {group.size()} ranks, the plan {plan.size}")
    model.shard(group)
    attn = model.layers[0].self_attn
    if getattr(attn, "n_heads", plan.heads // plan.size) != plan.heads // plan.size:
        raise ShardRefusal(f"{plan.family}: sharding left {attn.n_heads} heads per rank, expected "
                           f"{plan.heads // plan.size}")
