"""Tensor parallelism by rule: a family with no ``FAMILIES`` row shards when its layers have the plain layout.

The rule reads the model mlx-lm builds from config.json (without weights: MLX builds parameters lazily)
and accepts it when every decoder layer holds

- ``self_attn`` with separate ``q_proj``/``k_proj``/``v_proj``/``o_proj`` linears, a query head count
  (``n_heads``, ``num_heads`` or ``num_attention_heads``) and optionally a KV head count (``n_kv_heads``,
  ``num_kv_heads``, ``num_key_value_heads``) matching the projections' widths, optional ``q_norm`` /
  ``k_norm`` over one head (left as they are) or over all heads (RMSNorm: mlx-lm's ``ShardedRMSNorm``),
  and nothing else with parameters (no fused qkv, no attention sinks);
- a dense MLP (``gate_proj``/``up_proj``/``down_proj``) or a routed-experts block (a ``switch_mlp``
  SwitchGLU beside one router), and otherwise only norms;
- the same head counts as every other layer.

Anything else is refused by name with the reason. The cut is the one mlx-lm's llama ``shard()`` applies
(``shard_linear`` "all-to-sharded" for q/k/v and gate/up, "sharded-to-all" for o and down, head counts
divided by N); routed experts split as ``--tp-moe-mode`` says, their block all-reduced
(``megatron.Reduced``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from mlxcel.parallel.errors import ShardRefusal
from mlxcel.parallel.families import Dim, Experts, TPFamily, key

HEADS = ("n_heads", "num_heads", "num_attention_heads")
KV_HEADS = ("n_kv_heads", "num_kv_heads", "num_key_value_heads")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_NAMES = ("gate_proj", "up_proj", "down_proj")
MOE_BLOCKS = ("mlp", "block_sparse_moe", "moe", "feed_forward")
SWITCH = "switch_mlp"


@dataclass(frozen=True)
class Layout:
    """What the rule read from one model: its counts, and where they live."""

    heads: int
    kv_heads: int
    head_dim: int
    head_attr: str
    kv_attr: str | None
    full_norms: tuple[str, ...]  # q_norm / k_norm over all heads (sharded RMSNorms)
    intermediate: int | None  # dense MLP width
    moe_block: str | None  # the layer's attribute holding the routed experts
    experts: int = 0
    expert_width: int = 0

    def facts(self) -> dict[str, int]:
        """The values the plan's dimensions read (in place of config.json keys)."""
        found = {"heads": self.heads, "kv_heads": self.kv_heads, "attn_width": self.heads * self.head_dim}
        if self.intermediate:
            found["intermediate"] = self.intermediate
        if self.moe_block:
            found |= {"experts": self.experts, "expert_width": self.expert_width}
        return found

    def family(self) -> TPFamily:
        dims = (Dim("attention heads", "{} attention heads", "heads", key("heads"), key("attn_width")),
                Dim("KV heads", "{} KV heads", "KV heads", key("kv_heads")))
        if self.intermediate:
            dims += (Dim("intermediate size", "intermediate size {}", "MLP columns", key("intermediate"),
                         key("intermediate")),)
        experts = Experts("experts", "expert_width", self.moe_block, SWITCH) if self.moe_block else None
        return TPFamily("by rule", "rule", dims, experts, linear_reduces=not (experts or self.full_norms))


def _linear(module: Any) -> bool:
    import mlx.nn as nn

    return isinstance(module, (nn.Linear, nn.QuantizedLinear))


def _has_params(module: Any) -> bool:
    from mlx.utils import tree_flatten

    return bool(tree_flatten(module.parameters()))


def _count(attn: Any, names: tuple[str, ...]) -> tuple[str | None, int | None]:
    for name in names:
        value = getattr(attn, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return name, value
    return None, None


def _out_rows(linear: Any) -> int:
    return int(linear.weight.shape[0])


def _attention(i: int, layer: Any) -> tuple[int, int, int, str, str | None, tuple[str, ...]]:
    import mlx.nn as nn

    attn = getattr(layer, "self_attn", None)
    if not isinstance(attn, nn.Module):
        kids = ", ".join(k for k, v in layer.children().items() if isinstance(v, nn.Module)) or "none"
        raise ShardRefusal(f"layer {i} has no self_attn (its blocks: {kids}), so the plain attention rule does not "
                           "apply")
    for name, value in attn.items():
        if name in PROJECTIONS or name in ("q_norm", "k_norm") or name.startswith("_"):
            continue
        if hasattr(value, "shape"):
            raise ShardRefusal(f"layer {i}'s self_attn has a parameter {name!r} (attention sinks or another "
                               "per-head value) that the rule does not cut")
        if isinstance(value, nn.Module) and _has_params(value):
            what = "a fused QKV projection" if "qkv" in name else f"a {type(value).__name__} with parameters"
            raise ShardRefusal(f"layer {i}'s self_attn.{name} is {what}, not the separate q/k/v/o projections the "
                               "rule cuts")
    missing = [p for p in PROJECTIONS if not _linear(getattr(attn, p, None))]
    if missing:
        raise ShardRefusal(f"layer {i}'s self_attn has no {', '.join(missing)} linear")
    head_attr, heads = _count(attn, HEADS)
    if not heads:
        raise ShardRefusal(f"layer {i}'s self_attn names no head count ({', '.join(HEADS)})")
    kv_attr, kv = _count(attn, KV_HEADS)
    kv = kv or heads
    q_rows, k_rows = _out_rows(attn.q_proj), _out_rows(attn.k_proj)
    head_dim = q_rows // heads
    if q_rows % heads or k_rows != kv * head_dim:
        raise ShardRefusal(f"layer {i}'s projections ({q_rows} query, {k_rows} key rows) do not match "
                           f"{heads} heads and {kv} KV heads")
    return heads, kv, head_dim, head_attr, kv_attr, _norms(i, attn, head_dim, {"q_norm": q_rows, "k_norm": k_rows})


def _norms(i: int, attn: Any, head_dim: int, widths: Mapping[str, int]) -> tuple[str, ...]:
    import mlx.nn as nn

    full = []
    for name, width in widths.items():
        norm = getattr(attn, name, None)
        if norm is None or not _has_params(norm):
            continue
        size = int(norm.weight.shape[-1]) if "weight" in norm else 0
        if size == head_dim:
            continue
        if size == width and isinstance(norm, nn.RMSNorm):
            full.append(name)
            continue
        raise ShardRefusal(f"layer {i}'s self_attn.{name} ({type(norm).__name__} over {size}) is neither over one "
                           f"head ({head_dim}) nor an RMSNorm over all heads ({width})")
    return tuple(full)


def _mlp(i: int, layer: Any) -> tuple[str, int | None, int, int]:
    """(attribute, dense width or None, experts, expert width) of the layer's feed-forward block."""
    import mlx.nn as nn

    mlp = getattr(layer, "mlp", None)
    if isinstance(mlp, nn.Module) and all(_linear(getattr(mlp, n, None)) for n in MLP_NAMES):
        extra = [n for n, v in mlp.children().items() if n not in MLP_NAMES and isinstance(v, nn.Module)
                 and _has_params(v)]
        if extra or any(hasattr(v, "shape") for v in mlp.values()):
            raise ShardRefusal(f"layer {i}'s mlp has more than gate/up/down projections ({', '.join(extra)})")
        return "mlp", _out_rows(mlp.gate_proj), 0, 0
    for name in MOE_BLOCKS:
        block = getattr(layer, name, None)
        switch = getattr(block, SWITCH, None) if isinstance(block, nn.Module) else None
        if switch is None:
            continue
        others = [n for n, v in block.children().items() if n != SWITCH and isinstance(v, nn.Module)
                  and _has_params(v)]
        if len(others) != 1:
            raise ShardRefusal(f"layer {i}'s {name} has {', '.join(others) or 'no router'} beside its routed "
                               "experts, not the one router the rule keeps replicated (shared experts are not cut)")
        experts, width = (int(d) for d in switch.gate_proj.weight.shape[:2])
        return name, None, experts, width
    raise ShardRefusal(f"layer {i} has neither an mlp of gate/up/down projections nor a routed-experts block "
                       f"({SWITCH})")


def _others(i: int, layer: Any, used: tuple[str, ...]) -> None:
    import mlx.nn as nn

    for name, value in layer.children().items():
        if name in used or not isinstance(value, nn.Module) or "norm" in type(value).__name__.lower():
            continue
        if _has_params(value):
            raise ShardRefusal(f"layer {i}'s {name} ({type(value).__name__}) is neither attention, MLP nor a norm")


def read_layout(model: Any) -> Layout:
    """The plain layout of ``model``'s decoder layers, or ``ShardRefusal`` with the reason."""
    layers = list(getattr(model, "layers", None) or [])
    if not layers:
        raise ShardRefusal("the model has no decoder layers the rule can find (model.layers)")
    seen: Layout | None = None
    for i, layer in enumerate(layers):
        heads, kv, head_dim, head_attr, kv_attr, full = _attention(i, layer)
        block, width, experts, expert_width = _mlp(i, layer)
        _others(i, layer, ("self_attn", block))
        layout = Layout(heads, kv, head_dim, head_attr, kv_attr, full, width,
                        None if width else block, experts, expert_width)
        if seen is not None and layout != seen:
            raise ShardRefusal(f"layer {i}'s shapes ({heads} heads, {kv} KV heads, {width or expert_width} MLP "
                               f"width) differ from layer 0's (per-layer head counts or widths are not cut)")
        seen = layout
    assert seen is not None
    return seen


def layout_from_config(config: Mapping[str, Any]) -> Layout:
    """The layout of the model mlx-lm builds from ``config`` without weights."""
    from mlx_lm.utils import _get_classes

    try:
        model_cls, args_cls = _get_classes(dict(config))
    except ValueError as exc:
        raise ShardRefusal(f"mlx-lm has no model for it ({exc})") from None
    try:
        model = model_cls(args_cls.from_dict(dict(config)))
    except Exception as exc:  # noqa: BLE001 - a config mlx-lm cannot build
        raise ShardRefusal(f"mlx-lm cannot build it from config.json ({type(exc).__name__}: {exc})") from None
    return read_layout(model)


def shard(model: Any, group: Any, moe_mode: str | None) -> Layout:
    """Cut ``model`` in place by the rule (the routed experts' width too under ``within_expert``)."""
    from mlx.nn.layers.distributed import shard_inplace, shard_linear
    from mlx_lm.models.minimax import ShardedRMSNorm

    layout = read_layout(model)
    n = group.size()
    for layer in model.layers:
        attn = layer.self_attn
        for name in PROJECTIONS:
            how = "sharded-to-all" if name == "o_proj" else "all-to-sharded"
            setattr(attn, name, shard_linear(getattr(attn, name), how, group=group))
        for name in layout.full_norms:
            setattr(attn, name, ShardedRMSNorm.from_rms_norm(getattr(attn, name), group=group))
        for attr in (layout.head_attr, layout.kv_attr):
            if attr is not None:
                setattr(attn, attr, getattr(attn, attr) // n)
        if layout.intermediate:
            for name in MLP_NAMES:
                how = "sharded-to-all" if name == "down_proj" else "all-to-sharded"
                setattr(layer.mlp, name, shard_linear(getattr(layer.mlp, name), how, group=group))
        elif moe_mode == "within_expert":
            switch = getattr(getattr(layer, layout.moe_block), SWITCH)
            for name in MLP_NAMES:
                shard_inplace(getattr(switch, name), "sharded-to-all" if name == "down_proj" else "all-to-sharded",
                              group=group)
    return layout
