"""What one decoder layer costs, by its kind: the bytes it holds, the bytes a decode step reads, its cache.

No MLX here. A layer's **kind** comes from config.json arithmetic (``layer_kinds``): its attention
(full, a sliding window, MLA's compressed latent, or linear attention with a fixed-size state) and
its MLP (dense, or mixture-of-experts with ``experts`` routed experts of which ``active`` serve a
token). From the kind and the layer's weight bytes (the safetensors headers, or ``config_layer_bytes``
when there are no weights):

- **resident bytes** = its weights + its cache at the planned context (``cache_bytes``): what a stage
  must fit in its memory;
- **step bytes** = what one decode step of ``rows`` rows reads: every non-expert weight, the routed
  experts' weights times the share of experts the step can touch, min(1, rows x active / experts),
  and its cache (attention reads every cached position; a linear layer its state). A decode step is
  bound by memory bandwidth, so these bytes stand for its time.

So a dense layer and a 15 GB MoE layer differ by their real weight, and an MoE layer's step reads only
its active experts; a dense leading layer (deepseek's ``first_k_dense_replace``) reads all of its MLP.
``docs/pipeline.md`` ("Partition by cost") states the model and its limits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from mlxcel.models.identity import layer_count

FULL, SLIDING, MLA, LINEAR = "full", "sliding", "mla", "linear"
MAMBA, CONV, COMPRESSED, NONE = "mamba", "conv", "compressed", "none"  # NONE: an MLP-only layer (nemotron_h)
EXPERTS_KEYS = ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts")
ACTIVE_KEYS = ("num_experts_per_tok", "num_experts_per_token", "moe_k", "top_k_experts")
EXPERT_MARKERS = (".switch_mlp.", ".switch_glu.", ".experts.")  # stacked routed-expert tensors (mlx-lm names)


@dataclass(frozen=True)
class LayerKind:
    """One decoder layer's attention and MLP kind."""

    attention: str  # FULL, SLIDING, MLA, LINEAR, MAMBA, CONV, COMPRESSED or NONE
    experts: int = 0  # routed experts; 0 for a dense MLP
    active: int = 0  # routed experts per token (zero experts among the picks included)
    window: int | None = None  # SLIDING, COMPRESSED: the window
    heads: int | None = None  # this layer's own attention heads (step3p5's sliding layers), else the model's
    kv_heads: int | None = None  # this layer's own KV heads, else the model's
    zero: int = 0  # zero (identity) experts beside the routed ones: a pick of one reads no weight (longcat_flash)
    ratio: int = 0  # COMPRESSED: tokens pooled into one compressed row (deepseek_v41's compress_ratios)

    @property
    def name(self) -> str:
        """e.g. "mla+moe", "linear+dense"."""
        return f"{self.attention}+{'moe' if self.experts else 'dense'}"

    def touched(self, rows: int) -> float:
        """Routed experts a step of ``rows`` rows reads: its picks that are real experts, at most all of them."""
        real = self.active * self.experts / (self.experts + self.zero) if self.zero else self.active
        return min(float(self.experts), rows * real)


def text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The text model's fields (multimodal configs nest them in text_config)."""
    nested = config.get("text_config")
    return nested if isinstance(nested, Mapping) else config


def _first(config: Mapping[str, Any], keys: tuple[str, ...]) -> int:
    for key in keys:
        value = config.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return 0


def _is_moe(c: Mapping[str, Any], index: int) -> bool:
    """Whether layer ``index`` has routed experts, by the fields each family uses."""
    if not _first(c, EXPERTS_KEYS) or c.get("enable_moe_block") is False:
        return False
    if index < int(c.get("first_k_dense_replace") or 0) or index < int(c.get("moe_layer_start_index") or 0):
        return False
    end = c.get("moe_layer_end_index")
    if isinstance(end, int) and end >= 0 and index > end:
        return False
    if index in (c.get("mlp_only_layers") or []):
        return False
    step = int(c.get("decoder_sparse_step") or 1)
    if "decoder_sparse_step" in c and (index + 1) % step:
        return False
    freq = int(c.get("moe_layer_freq") or 1)
    return index % freq == 0


_BLOCK_TYPES = {"mamba": MAMBA, "conv": CONV, "attention": FULL, "full_attention": FULL, "mlp": NONE, "moe": NONE,
                "sliding_attention": SLIDING}
_PATTERN = {"M": MAMBA, "*": FULL, "-": NONE, "E": NONE}  # nemotron_h's hybrid_override_pattern


def _hybrid(c: Mapping[str, Any], index: int) -> str | None:
    """A hybrid decoder's layer type (Mamba, short convolution, attention, MLP only), None for others."""
    pattern = c.get("hybrid_override_pattern")
    if isinstance(pattern, (str, list)) and index < len(pattern):
        return _PATTERN[pattern[index]]
    blocks = c.get("layers_block_type")  # jamba, nemotron_h: every layer's type
    if isinstance(blocks, list) and index < len(blocks):
        return _BLOCK_TYPES[blocks[index]]
    types = c.get("layer_types")  # lfm2, granitemoehybrid: "conv" / "mamba" beside attention layers
    if isinstance(types, list) and index < len(types) and types[index] in ("mamba", "conv"):
        return _BLOCK_TYPES[types[index]]
    if isinstance(c.get("full_attn_idxs"), list) and "conv_L_cache" in c:  # lfm2
        return FULL if index in c["full_attn_idxs"] else CONV
    if "attn_layer_period" in c:  # jamba: attention every period-th layer from offset, else Mamba
        return FULL if index % int(c["attn_layer_period"]) == int(c.get("attn_layer_offset") or 0) else MAMBA
    return None


def bailing_mla_layers(c: Mapping[str, Any]) -> list[int]:
    """bailing_hybrid's MLA ("global") layers, as mlx-lm's DecoderLayer.is_global: every
    layer_group_size-th, and every layer of the tail after the last whole group; GLA in the others."""
    layers, group = int(c["num_hidden_layers"]), int(c["layer_group_size"])
    return [i for i in range(layers) if (i + 1) % group == 0 or i >= (layers // group) * group]


def _attention(c: Mapping[str, Any], index: int) -> tuple[str, int | None]:
    if c.get("model_type") == "bailing_hybrid" and "layer_group_size" in c:  # GLA (linear) beside MLA
        return (MLA, None) if index in bailing_mla_layers(c) else (LINEAR, None)
    hybrid = _hybrid(c, index)
    if hybrid is not None and hybrid != SLIDING:
        return hybrid, None
    ratios = c.get("compress_ratios")
    if isinstance(ratios, list) and index < len(ratios):  # deepseek_v41: a window + compressed rows
        return COMPRESSED, int(c.get("sliding_window") or 128)
    linear = c.get("linear_attn_config")
    if isinstance(linear, Mapping) and "kda_layers" in linear:  # kimi_k3: KDA where (i + 1) is listed, else MLA
        return (LINEAR, None) if index + 1 in linear["kda_layers"] else (MLA, None)
    if "linear_num_value_heads" in c and (index + 1) % int(c.get("full_attention_interval") or 4):
        return LINEAR, None  # qwen3_next, qwen3_5: gated delta net but every full_attention_interval-th layer
    if c.get("kv_lora_rank"):
        return MLA, None
    types = c.get("layer_types")
    window = c.get("sliding_window")
    if isinstance(types, list) and index < len(types):
        return (SLIDING, window) if types[index] == "sliding_attention" else (FULL, None)
    pattern = c.get("sliding_window_pattern")
    if isinstance(pattern, int) and pattern > 0 and window:
        return (FULL, None) if index % pattern == pattern - 1 else (SLIDING, window)
    return FULL, None


def _heads(c: Mapping[str, Any], attention: str) -> tuple[int | None, int | None]:
    """A sliding layer's own (heads, KV heads) where the model gives them (step3p5, baichuan_m1)."""
    if attention != SLIDING:
        return None, None
    other = c.get("attention_other_setting")
    if isinstance(other, Mapping):
        return other.get("num_attention_heads"), other.get("num_attention_groups")
    return c.get("num_swa_attention_heads"), c.get("num_swa_key_value_heads")


def _hybrid_moe(c: Mapping[str, Any], index: int) -> bool | None:
    """Whether a hybrid's layer ``index`` has routed experts by its own rule (None: the usual fields decide)."""
    pattern = c.get("hybrid_override_pattern")
    if isinstance(pattern, (str, list)) and index < len(pattern):
        return pattern[index] == "E"
    blocks = c.get("layers_block_type")
    if isinstance(blocks, list) and index < len(blocks) and "moe" in blocks:  # nemotron_h
        return blocks[index] == "moe"
    if "expert_layer_period" in c:  # jamba
        return index % int(c["expert_layer_period"]) == int(c.get("expert_layer_offset") or 0)
    return None


def layer_kinds(config: Mapping[str, Any]) -> list[LayerKind]:
    """Every layer's kind, from config.json (``text_config`` where nested)."""
    c = text_config(config)
    experts, active = _first(c, EXPERTS_KEYS), _first(c, ACTIVE_KEYS)
    zero = int(c.get("zero_expert_num") or 0)
    ratios = c.get("compress_ratios")
    kinds = []
    for index in range(layer_count(c)):
        attention, window = _attention(c, index)
        rule = _hybrid_moe(c, index)
        moe = bool(experts) and (_is_moe(c, index) if rule is None else rule)
        heads, kv_heads = _heads(c, attention)
        ratio = int(ratios[index]) if attention == COMPRESSED else 0
        kinds.append(LayerKind(attention, experts if moe else 0, active if moe else 0, window, heads, kv_heads,
                               zero if moe else 0, ratio))
    return kinds


def is_expert_tensor(name: str) -> bool:
    """A routed expert's weights (stacked over the experts); a shared expert is not one."""
    return any(marker in name for marker in EXPERT_MARKERS)


def step_bytes(kind: LayerKind, weights: int, expert_weights: int, rows: int = 1) -> int:
    """Weight bytes one decode step of ``rows`` rows reads from a layer of ``weights`` bytes, of which
    ``expert_weights`` are routed experts'."""
    if not kind.experts:
        return weights
    return weights - expert_weights + int(expert_weights * kind.touched(rows) // kind.experts)


def _kv_heads(c: Mapping[str, Any], kind: LayerKind) -> int:
    return int(kind.kv_heads or c.get("num_key_value_heads") or c.get("num_attention_groups")
               or c["num_attention_heads"])


def mamba_dims(c: Mapping[str, Any]) -> tuple[int, int, int, int, int]:
    """(inner width, state size, convolution kernel, groups, heads) of a Mamba layer; Mamba-1 (jamba) has
    neither groups nor heads (0)."""
    d = int(c["hidden_size"])
    state = _first(c, ("mamba_d_state", "ssm_state_size", "state_size"))
    conv = _first(c, ("mamba_d_conv", "conv_kernel", "mamba_conv_kernel")) or 4
    heads = _first(c, ("mamba_n_heads", "mamba_num_heads"))
    head_dim = _first(c, ("mamba_d_head", "mamba_head_dim"))
    inner = heads * head_dim if heads and head_dim else _first(c, ("mamba_d_ssm",)) or d * int(c.get("mamba_expand") or 2)
    groups = _first(c, ("mamba_n_groups", "n_groups")) or (1 if heads else 0)
    return inner, state, conv, groups, heads


def _state_bytes(c: Mapping[str, Any], kind: LayerKind, itemsize: int) -> int:
    """One sequence's fixed state: a Mamba layer's convolution window and float32 SSM state, a short
    convolution layer's window (lfm2: ``conv_L_cache`` - 1 positions of the hidden width); none for an MLP-only
    layer."""
    if kind.attention == NONE:
        return 0
    if kind.attention == CONV:
        return (int(c.get("conv_L_cache") or 3) - 1) * int(c["hidden_size"]) * itemsize
    inner, state, conv, groups, _ = mamba_dims(c)
    return (conv - 1) * (inner + 2 * groups * state) * itemsize + inner * state * 4


def _head_dim(c: Mapping[str, Any]) -> int:
    return int(c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])


def cache_bytes(config: Mapping[str, Any], kind: LayerKind, *, context: int, rows: int = 1, itemsize: int = 2) -> int:
    """The cache a layer holds for ``rows`` sequences of ``context`` tokens (``itemsize`` bytes a value):
    keys and values (full: every position; sliding: at most the window), MLA's latent and rope key, or
    a linear layer's fixed state (float32 recurrent state; its short convolution is left out)."""
    if not context:
        return 0
    c = text_config(config)
    if kind.attention in (MAMBA, CONV, NONE):
        return rows * _state_bytes(c, kind, itemsize)
    if kind.attention == COMPRESSED:  # the window, one row per ``ratio`` tokens, and their index keys
        compressed = context // kind.ratio if kind.ratio > 1 else 0
        index = int(c.get("index_head_dim") or 0) if kind.ratio > 1 else 0
        window = min(context, kind.window or context)
        return rows * ((window + compressed) * int(c["head_dim"]) + compressed * index) * itemsize
    if kind.attention == LINEAR:
        linear = c.get("linear_attn_config")
        if isinstance(linear, Mapping):  # kimi_k3's KDA: heads x head_dim x head_dim
            state = int(linear["num_heads"]) * int(linear["head_dim"]) ** 2
        elif "layer_group_size" in c:  # bailing_hybrid's GLA: heads x head_dim x head_dim
            state = int(c["num_attention_heads"]) * _head_dim(c) ** 2
        else:  # gated delta net: value heads x key dim x value dim
            state = int(c["linear_num_value_heads"]) * int(c["linear_key_head_dim"]) * int(c["linear_value_head_dim"])
        return rows * state * 4
    tokens = min(context, kind.window) if kind.attention == SLIDING and kind.window else context
    if kind.attention == MLA:
        per_token = int(c["kv_lora_rank"]) + int(c["qk_rope_head_dim"])
    else:
        per_token = 2 * _kv_heads(c, kind) * _head_dim(c)
    return rows * tokens * per_token * itemsize


# ---------------------------------------------------------------------------
# Weight bytes from config arithmetic (planning without the weights)


def _attention_params(c: Mapping[str, Any], kind: LayerKind) -> int:
    d, heads = int(c["hidden_size"]), int(kind.heads or c["num_attention_heads"])
    if kind.attention in (MAMBA, CONV, NONE):
        return _mixer_params(c, kind)
    if kind.attention == COMPRESSED:  # deepseek_v41: low-rank q, one shared KV row, grouped low-rank output
        hd, q_rank = int(c["head_dim"]), int(c.get("q_lora_rank") or 0)
        q = d * q_rank + q_rank * heads * hd if q_rank else d * heads * hd
        groups, o_rank = int(c.get("o_groups") or 1), int(c.get("o_lora_rank") or d)
        compress = (2 if kind.ratio > 1 else 1) * d * hd if kind.ratio else 0
        return q + d * hd + heads * hd * o_rank + groups * o_rank * d + compress  # wo_a per group, wo_b
    if kind.attention == MLA:
        nope, rope, v = int(c["qk_nope_head_dim"]), int(c["qk_rope_head_dim"]), int(c["v_head_dim"])
        q_rank, kv_rank = c.get("q_lora_rank"), int(c["kv_lora_rank"])
        q = d * q_rank + q_rank * heads * (nope + rope) if q_rank else d * heads * (nope + rope)
        return q + d * (kv_rank + rope) + kv_rank * heads * (nope + v) + heads * v * d
    if kind.attention == LINEAR:
        linear = c.get("linear_attn_config")
        if isinstance(linear, Mapping):  # KDA: qkv, low-rank forget and output gates, beta, output
            h, hd = int(linear["num_heads"]), int(linear["head_dim"])
            p = h * hd
            return 3 * d * p + 2 * (d * hd + hd * p) + d * h + p * d
        if "layer_group_size" in c:  # bailing_hybrid's GLA: fused q/k/v, gate and output projections
            return 5 * d * heads * _head_dim(c)
        hk, hv = int(c["linear_num_key_heads"]), int(c["linear_num_value_heads"])
        dk, dv = int(c["linear_key_head_dim"]), int(c["linear_value_head_dim"])
        return d * (2 * hk * dk + 2 * hv * dv) + d * 2 * hv + hv * dv * d
    kv_heads, hd = _kv_heads(c, kind), _head_dim(c)
    return d * heads * hd + 2 * d * kv_heads * hd + heads * hd * d


def _mixer_params(c: Mapping[str, Any], kind: LayerKind) -> int:
    """A Mamba layer's projections (Mamba-2: in to x, z, B, C and dt; Mamba-1: in, x, dt), a short
    convolution layer's (in to three streams, out), none for an MLP-only layer."""
    d = int(c["hidden_size"])
    if kind.attention == NONE:
        return 0
    if kind.attention == CONV:
        return 3 * d * d + d * d
    inner, state, conv, groups, heads = mamba_dims(c)
    if heads:
        return d * (2 * inner + 2 * groups * state + heads) + inner * d + conv * (inner + 2 * groups * state)
    rank = c.get("mamba_dt_rank")
    rank = int(rank) if isinstance(rank, int) else math.ceil(d / 16)
    return d * 2 * inner + inner * (rank + 2 * state) + rank * inner + inner * d + conv * inner + inner * state


def _moe_width(c: Mapping[str, Any]) -> int:
    return int(c.get("moe_intermediate_size") or c.get("expert_ffn_hidden_size") or c["intermediate_size"])


def _shared_params(c: Mapping[str, Any]) -> int:
    d = int(c["hidden_size"])
    width = int(c.get("shared_expert_intermediate_size") or 0)
    shared = _first(c, ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts"))
    return 3 * d * (width or shared * _moe_width(c))


def config_layer_bytes(config: Mapping[str, Any], kind: LayerKind, *, bits: float = 16) -> tuple[int, int]:
    """(weight bytes, routed-expert bytes of them) of a layer of ``kind``, from config arithmetic at
    ``bits`` per parameter (4-bit with a 16-bit scale and bias per 64 weights is 4.5). Norms and biases
    are left out: they are a rounding error beside the projections."""
    c = text_config(config)
    d = int(c["hidden_size"])
    attention = _attention_params(c, kind)
    if kind.experts:
        experts = kind.experts * 3 * d * _moe_width(c)
        other = attention + _shared_params(c) + d * kind.experts  # + the router
    else:
        experts, other = 0, attention + 3 * d * int(c["intermediate_size"])
    to_bytes = lambda params: math.ceil(params * bits / 8)  # noqa: E731
    return to_bytes(other + experts), to_bytes(experts)
