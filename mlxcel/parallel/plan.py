"""Which checkpoints shard over N ranks, decided from config.json alone (before any weight is read).

A layer shards Megatron-style: q/k/v and gate/up keep 1/N of their output rows (``all-to-sharded``),
o_proj and down_proj 1/N of their input columns and all-reduce their output (``sharded-to-all``).
So N must divide every dimension the family's row in ``mlxcel.parallel.families`` lists (attention
heads, KV heads, intermediate size, linear-attention heads, shared expert width, ...) and, for a
quantized checkpoint, each rank's share of every reduced input must be whole quantization groups.
A mixture-of-experts checkpoint also splits its routed experts by ``--tp-moe-mode``: whole experts
per rank (``expert_parallel``: N must divide the experts) or every expert's width
(``within_expert``: N must divide the expert width). Embedding and LM head stay replicated.
A family with no row shards by rule (``mlxcel.parallel.rule``) when its model, built from config.json
without weights, has the plain attention + MLP (+ experts) layout; the dimensions are then read from
the model, and a layout the rule does not cut is refused with the reason.
``apply_plan`` then cuts the loaded model: the row's ``shard`` (mlx-lm's ``Model.shard(group)``,
mlxcel's own plan, or the rule), with the experts placed by ``mlxcel.parallel.experts``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import gcd
from pathlib import Path
from typing import Any, Mapping

from mlxcel.config import DEFAULT_TP_MOE_MODE, TP_MOE_MODES
from mlxcel.parallel.errors import ShardRefusal
from mlxcel.parallel.families import FAMILIES, FAMILIES_HELP, REFUSED, Dim, TPFamily, is_moe, key, text_config

__all__ = ["FAMILIES", "FAMILIES_HELP", "ShardPlan", "apply_plan", "check_shardable", "working_sizes"]


@dataclass(frozen=True)
class ShardPlan:
    """How one checkpoint splits over ``size`` ranks: (unit, whole value) of every split dimension."""

    family: str
    size: int
    dims: tuple[tuple[str, int], ...]
    moe_mode: str | None = None  # None: no routed experts
    experts: int = 0
    row: TPFamily | None = field(default=None, compare=False)  # how it is cut (None: ``FAMILIES[family]``)

    @property
    def tp_family(self) -> TPFamily:
        return self.row if self.row is not None else FAMILIES[self.family]

    def describe(self) -> str:
        n = self.size
        parts = [f"{max(1, v // n)} of {v} {unit}" for unit, v in self.dims]
        if self.moe_mode == "expert_parallel":
            parts.append(f"{self.experts // n} of {self.experts} experts")
        elif self.moe_mode == "within_expert":
            parts.append(f"all {self.experts} experts")
        rule = " (by rule)" if self.tp_family.shard == "rule" else ""
        return f"{self.family}{rule} over {n} ranks: {', '.join(parts)} per rank"


def working_sizes(*dims: int) -> list[int]:
    """Every rank count that divides all ``dims``."""
    g = 0
    for d in dims:
        g = gcd(g, d)
    return [n for n in range(1, g + 1) if g % n == 0]


def _family(config: Mapping[str, Any], where: str) -> tuple[str, TPFamily, Mapping[str, Any]]:
    """(model_type, its row, the mapping the row's dimensions read): the table's, else the rule's."""
    name = str(config.get("model_type"))
    if name in REFUSED:
        raise ShardRefusal(f"{where}: model family {name!r} is not supported by tensor parallelism: {REFUSED[name]}")
    if name in FAMILIES:
        return name, FAMILIES[name], config
    from mlxcel.parallel.rule import layout_from_config

    try:
        layout = layout_from_config(text_config(config))
    except ShardRefusal as exc:
        raise ShardRefusal(f"{where}: model family {name!r} is not supported by tensor parallelism: it has no "
                           f"row and the plain-layout rule refuses it: {exc}") from None
    return name, layout.family(), layout.facts()


def _values(dims: tuple[Dim, ...], text: Mapping[str, Any], where: str) -> list[tuple[Dim, int]]:
    found = []
    for i, dim in enumerate(dims):
        value = dim.get(text)
        if value is None and i == 0:
            raise ShardRefusal(f"{where}: config.json has no positive integer {dim.name}, so it cannot be sharded")
        if value is None:
            continue
        if value <= 0:
            raise ShardRefusal(f"{where}: config.json's {dim.name} must be a positive integer, got {value}")
        found.append((dim, value))
    return found


def _moe_mode(name: str, family: TPFamily, config: Mapping[str, Any], mode: str | None, where: str) -> str | None:
    if mode is not None and mode not in TP_MOE_MODES:
        raise ShardRefusal(f"--tp-moe-mode {mode!r} is not one of {', '.join(TP_MOE_MODES)}")
    if not is_moe(family, config):
        if mode not in (None, DEFAULT_TP_MOE_MODE):
            raise ShardRefusal(f"{where}: --tp-moe-mode {mode} does not apply: this {name} checkpoint has no routed "
                               "experts (leave --tp-moe-mode out)")
        return None
    return mode or DEFAULT_TP_MOE_MODE


def _expert_dim(family: TPFamily, mode: str) -> Dim:
    assert family.experts is not None
    ex = family.experts
    if mode == "expert_parallel":
        return Dim(f"routed experts ({ex.count})", "{} routed experts", "experts", ex.experts)
    return Dim(f"expert width ({ex.width})", "expert width {}", "expert columns", key(ex.width), key(ex.width))


def _check_divides(found: list[tuple[Dim, int]], size: int, where: str, mode: str | None) -> None:
    strict = [v for d, v in found if not d.repeats]
    for dim, value in found:
        if value % size == 0 or (dim.repeats and size % value == 0):
            continue
        works = ", ".join(str(n) for n in working_sizes(*strict))
        summary = ", ".join(d.phrase.format(v) for d, v in found)
        also = ""
        if mode == "expert_parallel" and dim.unit == "experts":
            also = " (--tp-moe-mode within_expert splits each expert's width instead)"
        elif mode == "within_expert" and dim.unit == "expert columns":
            also = " (--tp-moe-mode expert_parallel places whole experts instead)"
        either = " or divide" if dim.repeats else ""
        raise ShardRefusal(f"{where} does not shard across {size} ranks: {dim.name} ({value}) is not divisible by "
                           f"{size}{either}{also} (this model has {summary}; --tp-size values that work: {works})")


def _check_quantized(config: Mapping[str, Any], text: Mapping[str, Any], size: int,
                     found: list[tuple[Dim, int]], where: str) -> None:
    quant = config.get("quantization") or config.get("quantization_config")
    if not isinstance(quant, Mapping):
        return
    group = quant.get("group_size")
    if not isinstance(group, int) or group <= 0:
        return
    for dim, _ in found:
        width = dim.width(text) if dim.width is not None else None
        if not isinstance(width, int) or width <= 0:
            continue
        name = "attention output width (heads x head_dim)" if dim.unit == "heads" else dim.name
        if (width // size) % group:
            raise ShardRefusal(f"{where} does not shard across {size} ranks: each rank's share of the {name} "
                               f"({width} / {size} = {width // size}) is not a whole number of quantization "
                               f"groups of {group}")


def check_shardable(config: Mapping[str, Any], size: int, where: str | Path = "the model",
                    moe_mode: str | None = None) -> ShardPlan:
    """The plan for ``size`` ranks, or ``ShardRefusal`` naming the dimension that does not divide.

    ``moe_mode``: ``--tp-moe-mode`` as given (None: not given; MoE checkpoints then take the default).
    """
    where = str(where)
    name, family, read = _family(config, where)
    text = text_config(read)
    mode = _moe_mode(name, family, read, moe_mode, where)
    dims = family.dims + ((_expert_dim(family, mode),) if mode else ())
    found = _values(dims, text, where)
    _check_divides(found, size, where, mode)
    _check_quantized(config, text, size, found, where)
    experts = family.experts.experts(text) if mode and family.experts else 0
    shown = tuple((d.unit, v) for d, v in found if d.unit not in ("experts", "expert columns"))
    if mode == "within_expert":
        shown += tuple((d.unit, v) for d, v in found if d.unit == "expert columns")
    return ShardPlan(name, size, shown, mode, experts or 0, None if family.shard != "rule" else family)


def apply_plan(model: Any, plan: ShardPlan, group: Any) -> None:
    """Shard ``model`` in place over ``group`` as its family's row says."""
    from mlxcel.parallel.cut import cut

    if group.size() != plan.size:
        raise ShardRefusal(f"the distributed group has {group.size()} ranks, the plan {plan.size}")
    cut(model, plan.tp_family, plan.moe_mode, group)
