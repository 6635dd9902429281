"""Layers every pipeline stage must hold one of, and split points a family forbids, read from config.json
(no weights, no MLX).

A family whose layers read state from another layer of their own stage cannot have a stage without
such a layer: bailing_hybrid's linear-attention (GLA) layers rope at the position offset the forward
reads from an MLA layer's cache, so each stage holds an MLA layer (mlx-lm's own pipeline split
refuses a rank without one). ``needed_layers`` names them; the planner (``partition.plan_stages``)
never makes a stage without one, and given ranges that do are refused (``partition.stages_for_ranges``).
deepseek_v41's attention shares state with later layers that no stage boundary carries:
``deepseek_v41_joined`` names the stage starts it forbids (``partition.joined_boundaries``).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from mlxcel.topology.layer_cost import bailing_mla_layers, text_config


def _bailing_why(c: Mapping[str, Any], needed: list[int]) -> str:
    return (f"bailing_hybrid's linear-attention layers read the position from an MLA layer's cache of their "
            f"stage, so every stage must hold an MLA layer (every {c['layer_group_size']}th layer and the tail: "
            f"layers {', '.join(map(str, needed))})")


def _deepseek_v41_reads(c: Mapping[str, Any], layer: int) -> dict[str, int]:
    """The attention state deepseek_v41's layer ``layer`` reads, as {what: the layer that computes it}, as
    mlx-lm's ``_shared_reads``: the compressed KV of the last KV source, the index keys of the last KV and
    index source (an index layer) or the top-k of the last index layer (another), the candidate blocks."""
    ratios = list(c.get("compress_ratios") or ())
    if layer >= len(ratios) or not ratios[layer]:
        return {}
    kv, index = set(c.get("kv_source_layer_ids") or ()), set(c.get("index_source_layer_ids") or ())

    def last(match: Callable[[int], bool]) -> int | None:
        return max((j for j in range(layer + 1) if match(j)), default=None)

    reads = {"compress_kv": last(lambda j: j in kv and ratios[j])}
    if layer in index:
        reads["index_k"] = last(lambda j: j in kv and j in index)
        source = int(c.get("candidate_source_layer_id", -1))
        if 0 <= source < layer and int(c.get("candidate_topk_blocks", 2048)) > 0:
            reads["candidates"] = source
    else:
        reads["topk_idx"] = last(lambda j: j in index)
    return {key: source for key, source in reads.items() if source is not None}


def deepseek_v41_joined(config: Mapping[str, Any]) -> tuple[frozenset[int], str]:
    """The stage starts deepseek_v41 forbids, and why: a boundary before a layer that reads attention state an
    earlier layer computes in the same forward pass (``_deepseek_v41_reads``), which no boundary carries."""
    c = text_config(config)
    layers = int(c["num_hidden_layers"])
    crossed = {b: (key, source) for b in range(1, layers) for layer in range(b, layers)
               for key, source in _deepseek_v41_reads(c, layer).items() if source < b}
    if not crossed:
        return frozenset(), ""
    shown = ", ".join(f"{b} ({key} of layer {source})" for b, (key, source) in sorted(crossed.items())[:4])
    why = (f"deepseek_v41's later layers read attention state (compressed KV, index keys, top-k, candidates) that "
           f"earlier layers compute in the same forward pass, which a stage boundary does not carry, so no stage "
           f"starts at layers {shown}{', ...' if len(crossed) > 4 else ''}")
    return frozenset(crossed), why


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
