"""Layers every pipeline stage must hold one of, read from config.json (no weights, no MLX).

A family whose layers read state from another layer of their own stage cannot have a stage without
such a layer: bailing_hybrid's linear-attention (GLA) layers rope at the position offset the forward
reads from an MLA layer's cache, so each stage holds an MLA layer (mlx-lm's own pipeline split
refuses a rank without one). ``needed_layers`` names them; the planner (``partition.plan_stages``)
never makes a stage without one, and given ranges that do are refused (``partition.stages_for_ranges``).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from mlxcel.topology.layer_cost import text_config


def bailing_mla_layers(c: Mapping[str, Any]) -> list[int]:
    """bailing_hybrid's MLA ("global") layers, as mlx-lm's DecoderLayer.is_global: every
    layer_group_size-th, and every layer of the tail after the last whole group."""
    layers, group = int(c["num_hidden_layers"]), int(c["layer_group_size"])
    return [i for i in range(layers) if (i + 1) % group == 0 or i >= (layers // group) * group]


def _bailing_why(c: Mapping[str, Any], needed: list[int]) -> str:
    return (f"bailing_hybrid's linear-attention layers read the position from an MLA layer's cache of their "
            f"stage, so every stage must hold an MLA layer (every {c['layer_group_size']}th layer and the tail: "
            f"layers {', '.join(map(str, needed))})")


# model_type -> (the layers every stage must hold one of, why given them)
NEEDS: dict[str, tuple[Callable[[Mapping[str, Any]], list[int]], Callable[[Mapping[str, Any], list[int]], str]]] = {
    "bailing_hybrid": (bailing_mla_layers, _bailing_why),
}


def needed_layers(config: Mapping[str, Any]) -> tuple[frozenset[int], str]:
    """The layers of which every stage must hold at least one, and why; (empty, "") where any split goes."""
    c = text_config(config)
    rule = NEEDS.get(str(c.get("model_type") or config.get("model_type")))
    if rule is None:
        return frozenset(), ""
    layers, why = rule
    try:
        needed = layers(c)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
        raise ValueError(f"config.json lacks what its stage rule reads ({exc!r})") from None
    return frozenset(needed), why(c, needed)
